"""Request-line and header fuzzing with boofuzz, as Triton's qa/L0_http_fuzz does (issue 36): for every endpoint, the
method, the URI, the version, a header's name and value and the line endings are mutated by boofuzz's own
generators, each case sent on its own connection; every answer must be a well-formed HTTP response below 500 (or
the connection closed unanswered: a head that never ends, at the header deadline), and the server must serve right
afterwards.

``make test`` runs a bounded sample: ``ADDNORM_HTTP_FUZZ_CASES`` cases per endpoint (default 12), drawn with the
printed seed (``ADDNORM_HTTP_FUZZ_SEED``, default 36) from boofuzz's enumeration; ``make fuzz-http`` runs every
case of every endpoint (about 8,000 each)."""

from __future__ import annotations

import json
import os
import random
import warnings
from collections.abc import Iterator

import pytest
from boofuzz import (
    Block,
    Delim,
    FuzzLoggerText,
    Group,
    Request,
    Session,
    Static,
    String,
    Target,
    TCPSocketConnection,
)

from bench.server import ServerProcess
from tests.conftest import start_server
from tests.helpers import raw_http

pytestmark = pytest.mark.server

SEED = int(os.environ.get("ADDNORM_HTTP_FUZZ_SEED", "36"))
CASES = int(os.environ.get("ADDNORM_HTTP_FUZZ_CASES", "12"))  # per endpoint; 0: every case boofuzz has
ENDPOINTS = [
    "/v1/encode",
    "/v1/model",
    "/v2",
    "/v2/models/encoder",
    "/v2/models/encoder/versions/1/infer",
    "/v2/models/encoder/infer",
    "/v2/models/encoder/ready",
    "/v2/models/encoder/config",
    "/v2/models/encoder/stats",
    "/v2/health/ready",
    "/v2/health/live",
    "/v2/repository/index",
    "/v2/repository/models/encoder/load",
    "/metrics",
    "/docs",
]


@pytest.fixture(scope="module")
def server(tiny_artifact) -> Iterator[ServerProcess]:
    with start_server(tiny_artifact, "--header-timeout-s", "1", "--body-timeout-s", "1") as srv:
        yield srv


def _request(url: str) -> Request:
    """One request as boofuzz describes it: the request line, one header field, the blank line."""
    return Request(
        url,
        children=(
            Block(
                name="request-line",
                children=(
                    Group(
                        name="method",
                        values=["GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE"],
                    ),
                    Delim(name="space-1", default_value=" "),
                    String(name="uri", default_value=url),
                    Delim(name="space-2", default_value=" "),
                    String(name="version", default_value="HTTP/1.1"),
                    Delim(name="line-end", default_value="\r\n"),
                ),
            ),
            Block(
                name="header",
                children=(
                    String(name="field-name", default_value="Content-Type"),
                    Delim(name="colon", default_value=":"),
                    Delim(name="space-3", default_value=" "),
                    String(name="field-value", default_value="application/json"),
                    Delim(name="field-end", default_value="\r\n"),
                ),
            ),
            Static(name="connection", default_value="Connection: close\r\n"),
            Static(name="end", default_value="\r\n"),
        ),
    )


class Answers:
    """boofuzz's post-test-case callback: every answer's status line, or the case that broke the rule."""

    __name__ = "answers"  # boofuzz names its callbacks

    def __init__(self) -> None:
        self.statuses: dict[str, int] = {}
        self.broken: list[str] = []

    def __call__(self, target, fuzz_data_logger, session, *args, **kwargs) -> None:
        got = bytes(session.last_recv or b"")
        case = f"case {session.total_mutant_index}: {bytes(session.last_send or b'')[:160]!r}"
        if not got:  # closed unanswered: an unfinished head (the header deadline) is the only reason allowed
            self.statuses["closed"] = self.statuses.get("closed", 0) + 1
            return
        line = got.split(b"\r\n", 1)[0].split(b" ")
        if len(line) < 2 or line[0] != b"HTTP/1.1" or not line[1].isdigit():
            self.broken.append(f"{case} -> not an HTTP response: {got[:120]!r}")
            return
        status = int(line[1])
        self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1
        if status >= 500:
            self.broken.append(f"{case} -> {got[:300]!r}")


def _fuzz(port: int, url: str, indices: list[int] | None, answers: Answers, log, db: str) -> int:
    """Send the cases ``indices`` (every case when None) of ``url``'s request; how many there were in all."""
    request = _request(url)
    total = request.get_num_mutations()
    windows = [(1, total)] if indices is None else [(i, i) for i in indices]
    for start, end in windows:
        session = Session(
            target=Target(connection=TCPSocketConnection("127.0.0.1", port, recv_timeout=5.0)),
            index_start=start,
            index_end=end,
            web_port=None,
            keep_web_open=False,
            fuzz_loggers=[FuzzLoggerText(file_handle=log)],
            post_test_case_callbacks=[answers],
            receive_data_after_fuzz=True,
            ignore_connection_reset=True,
            ignore_connection_aborted=True,
            db_filename=db,
        )
        session.connect(request)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            session.fuzz()
    return total


def test_request_line_and_header_fuzzing_never_gets_a_5xx(server, tmp_path, capsys):
    rng = random.Random(SEED)
    answers = Answers()
    sent = 0
    with open(tmp_path / "boofuzz.log", "w") as log:
        for url in ENDPOINTS:
            total = _request(url).get_num_mutations()
            indices = None if CASES <= 0 else sorted(rng.sample(range(1, total + 1), min(CASES, total)))
            _fuzz(server.port, url, indices, answers, log, str(tmp_path / "boofuzz.db"))
            sent += total if indices is None else len(indices)
            status, body = raw_http(
                server.port, [b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"]
            )
            assert status == 200, (url, body[:200])
    with capsys.disabled():
        print(
            f"\nhttp fuzz: seed {SEED}, {sent} cases over {len(ENDPOINTS)} endpoints, answers {answers.statuses}"
        )
    assert not answers.broken, answers.broken[:10]
    assert sum(answers.statuses.values()) == sent  # every case was sent and its answer read
    assert server.proc.poll() is None
    v1 = json.dumps({"embeddings": [[0.5] * 32] * 2}).encode()
    head = b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
    assert raw_http(server.port, [head + b"Content-Length: %d\r\n\r\n" % len(v1) + v1])[0] == 200


def test_the_rule_fails_a_5xx_and_a_garbled_answer():
    class Seen:
        total_mutant_index, last_send = 7, b"GET / HTTP/1.1\r\n\r\n"
        last_recv = b""

    answers = Answers()
    for got in (b"HTTP/1.1 200 OK\r\n\r\n", b"", b"HTTP/1.1 500 Internal Server Error\r\n\r\n", b"garbage"):
        Seen.last_recv = got
        answers(None, None, Seen)
    assert answers.statuses == {"200": 1, "closed": 1, "500": 1}
    assert len(answers.broken) == 2 and "500" in answers.broken[0] and "not an HTTP" in answers.broken[1]
