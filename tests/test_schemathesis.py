"""schemathesis against the served OpenAPI document: generated requests for every operation, no answer >= 500, and
every answer as documented (its status code, content type, headers and body schema): the document and the codecs
cannot drift apart unnoticed."""

from tests.helpers import run_schemathesis


def test_schemathesis_finds_no_server_error_and_every_answer_is_documented(server, tmp_path):
    run_schemathesis(server, "encoder", tmp_path)
