import json

import pytest

from addnorm.model.artifact import ArtifactError, Manifest, load_verified, sha256_file


def test_manifest_round_trip(tiny_artifact):
    manifest = Manifest.load(tiny_artifact)
    assert Manifest.from_dict(manifest.to_dict()) == manifest
    assert manifest.name == "encoder" and manifest.variant == "fp32" and manifest.opset >= 17
    assert [s.name for s in manifest.inputs] == ["embeddings", "mask"]
    assert manifest.model_sha256 == sha256_file(tiny_artifact / "model.onnx")


def test_tampered_graph_is_refused(tiny_artifact, tmp_path):
    copy = tmp_path / "a"
    copy.mkdir()
    for name in ("manifest.json", "model.onnx", "weights.safetensors"):
        (copy / name).write_bytes((tiny_artifact / name).read_bytes())
    with open(copy / "model.onnx", "ab") as fh:
        fh.write(b"\0")
    with pytest.raises(ArtifactError, match="sha256"):
        load_verified(copy)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{", "not valid JSON"),
        ("[]", "JSON object"),
        ('{"format_version": 99}', "format_version"),
        ('{"format_version": 1, "name": "x"}', "malformed"),
    ],
)
def test_bad_manifests_name_the_problem(tmp_path, content, message):
    (tmp_path / "manifest.json").write_text(content)
    with pytest.raises(ArtifactError, match=message):
        Manifest.load(tmp_path)


def test_missing_artifact_says_how_to_make_one(tmp_path):
    with pytest.raises(ArtifactError, match="does not exist"):
        load_verified(tmp_path / "nope")
    with pytest.raises(ArtifactError, match="addnorm-export"):
        load_verified(tmp_path)


def test_manifest_is_plain_json(tiny_artifact):
    doc = json.loads((tiny_artifact / "manifest.json").read_text())
    assert doc["parity"]["passed"] is True
    assert doc["parity"]["max_abs_err"] <= 1e-5
    assert {"torch", "onnx", "onnxruntime"} <= set(doc["versions"])


@pytest.mark.parametrize(
    ("scheme", "message"),
    [
        ([], "scheme must be an object"),
        ({"float_channels": {"layers.0.linear1.weight": [1, -2]}}, "lists of channel indices"),
        ({"float_channels": {"layers.0.linear1.weight": "3"}}, "lists of channel indices"),
        ({"float_channels": [[1]]}, "lists of channel indices"),
        ({"weights": "4bit", "rows": "minmax"}, "unknown int8 form"),
        ({"rows": "absmax"}, "unknown int8 form"),
    ],
)
def test_a_malformed_scheme_is_named(tiny_artifact, scheme, message):
    """int8's float channels travel in the manifest's scheme; a malformed one is refused when read, not at a
    live parity check in the middle of serving."""
    doc = Manifest.load(tiny_artifact).to_dict()
    assert "scheme" not in doc  # fp32 has none
    with pytest.raises(ArtifactError, match=message):
        Manifest.from_dict({**doc, "scheme": scheme})
    good = {"float_channels": {"layers.0.linear1.weight": [3, 1]}}
    assert Manifest.from_dict({**doc, "scheme": good}).to_dict()["scheme"] == good
