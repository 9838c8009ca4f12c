"""``localctx run --json-schema FILE``: the answer is JSON valid against the file's schema (llama.cpp's
grammar on the bundled SmolLM2); a file that cannot be used, or a schema the engine cannot enforce,
is refused in one line with exit code 2 before anything is generated."""
import json

import jsonschema
import pytest

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "colour"],
          "properties": {"answer": {"enum": ["yes", "no"]}, "colour": {"type": "string", "maxLength": 12}}}


def _one_line(res, *words):
    assert res.code == 2, (res.code, res.err)
    lines = res.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("localctx: error: --json-schema"), res.err
    for w in words:
        assert w in lines[0], lines[0]
    assert res.out == ""


@pytest.mark.slow
def test_the_answer_validates(cli, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    res = cli("run", "--backend", "llamacpp", "--json-schema", str(path), "--max-tokens", "60", "--json",
              "Is the sky blue? Say which colour it is.")
    assert res.code == 0, res.err
    out = json.loads(res.out)
    assert out["finish_reason"] == "stop"
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert out["stats"]["speculate"].startswith("off (")  # drafts are off under a grammar


def test_bad_files_are_refused_in_one_line(cli, tmp_path):
    _one_line(cli("run", "--backend", "fake", "--json-schema", str(tmp_path / "missing.json"), "hi"),
              "cannot read it", "No such file")
    broken = tmp_path / "broken.json"
    broken.write_text('{"type": ')
    _one_line(cli("run", "--backend", "fake", "--json-schema", str(broken), "hi"), "not JSON")
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    _one_line(cli("run", "--backend", "fake", "--json-schema", str(listed), "hi"), "is an object", "not list")
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe\x00")
    _one_line(cli("run", "--backend", "fake", "--json-schema", str(binary), "hi"), "not UTF-8")


def test_a_schema_the_engine_cannot_enforce_is_refused(cli, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    _one_line(cli("run", "--backend", "fake", "--json-schema", str(path), "hi"),
              "the fake backend has no constrained decoding")
    bounded = tmp_path / "bounded.json"
    bounded.write_text('{"type": "integer", "minimum": 1}')
    _one_line(cli("run", "--backend", "llamacpp", "--json-schema", str(bounded), "hi"),
              "llama.cpp's grammar cannot enforce 'minimum'")
