"""Inputs: formats, bad files reported and skipped, the CLI's exit codes and --json stream."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from localctx.app import cli
from localctx.app.summarize.html_text import html_to_text
from localctx.app.summarize.inputs import Document, InputFile, Skipped, discover, read
from summarize_helpers import outputs, run


def make_pdf(text: str) -> bytes:
    content = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
               b"/Resources << /Font << /F1 5 0 R >> >> >>",
               b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream",
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def test_html_is_stripped_to_text_with_headings():
    text = html_to_text("<html><head><title>t</title><style>p{}</style></head><body><h2>Cache</h2>"
                        "<p>Keys &amp; values.</p><script>alert(1)</script><ul><li>one</li><li>two</li></ul></body>")
    assert text == "## Cache\n\nKeys & values.\n\none\ntwo\n"


def test_pdf_text_is_extracted(tmp_path):
    pytest.importorskip("pypdf")
    path = tmp_path / "doc.pdf"
    path.write_bytes(make_pdf("Attention sinks keep the first tokens"))
    doc = read(InputFile(path, "doc.pdf"))
    assert isinstance(doc, Document) and "Attention sinks keep the first tokens" in doc.text


@pytest.mark.parametrize("name, data, reason", [
    ("nul.txt", b"abc\x00def", "binary"),
    ("empty.md", b"", "empty"),
    ("blank.txt", b"  \n\t\n", "empty"),
    ("latin1.txt", "caf\xe9 cr\xe8me".encode("latin-1"), "not UTF-8"),
    ("broken.pdf", b"%PDF-1.4 this is not a pdf", "PDF"),
    ("image.png", b"\x89PNG\r\n", "unsupported file type"),
])
def test_bad_files_become_skipped_with_a_reason(tmp_path, name, data, reason):
    if name.endswith(".pdf"):
        pytest.importorskip("pypdf")
    path = tmp_path / name
    path.write_bytes(data)
    result = read(InputFile(path, name))
    assert isinstance(result, Skipped) and reason in result.reason


def test_folders_are_walked_and_mirrored(tmp_path):
    (tmp_path / "in" / "a" / "b").mkdir(parents=True)
    (tmp_path / "in" / "a" / "b" / "x.md").write_text("x")
    (tmp_path / "in" / "y.txt").write_text("y")
    (tmp_path / "in" / ".hidden.txt").write_text("h")
    (tmp_path / "in" / "z.bin").write_bytes(b"\x00")
    files, ignored = discover([str(tmp_path / "in")], tmp_path / "in" / "out")
    assert [f.key for f in files] == ["a/b/x.md", "y.txt"]
    assert [s.key for s in ignored] == ["z.bin"] and ignored[0].ignored


def test_batch_goes_on_past_bad_files_and_exits_3(tmp_path):
    good = tmp_path / "in"
    good.mkdir()
    (good / "ok.txt").write_text("A fine document about quantized caches.")
    (good / "bin.txt").write_bytes(b"\x00\x01\x02garbage")
    (good / "empty.txt").write_text("")
    (good / "latin.txt").write_bytes("d\xe9j\xe0".encode("latin-1"))
    os.symlink(tmp_path / "missing.txt", good / "dangling.txt")  # unreadable, even as root
    report, events = run([good], tmp_path / "out")
    status = {d["path"]: (d["status"], d.get("reason", "")) for d in report["documents"]}
    assert status["ok.txt"][0] == "done"
    assert {k: v[0] for k, v in status.items() if k != "ok.txt"} == {
        "bin.txt": "skipped", "empty.txt": "skipped", "latin.txt": "skipped", "dangling.txt": "skipped"}
    assert "unreadable" in status["dangling.txt"][1] and "binary" in status["bin.txt"][1]
    assert report["exit_code"] == 3
    assert list(outputs(tmp_path / "out")) == ["ok.txt.summary.md"]
    assert [e["event"] for e in events].count("skipped") == 4


def test_cli_json_lines_and_exit_codes(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("Alpha document. " * 50)
    (tmp_path / "b.md").write_text("# B\n\nBeta document.\n")
    code = cli.main(["summarize", str(tmp_path / "a.txt"), str(tmp_path / "b.md"), "--out", str(tmp_path / "out"),
                     "--backend", "fake", "--json"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0
    assert lines[0]["event"] == "start" and lines[-1]["event"] == "done" and lines[-1]["exit_code"] == 0
    assert {e["path"] for e in lines if e["event"] == "document_done"} == {"a.txt", "b.md"}
    assert (tmp_path / "out" / "a.txt.summary.md").read_text().startswith("Reply:")
    report = json.loads((tmp_path / "out" / "summarize-report.json").read_text())
    assert report["counts"]["done"] == 2 and report["prompt_version"].startswith("1-")


@pytest.mark.parametrize("argv, message", [
    (["summarize", "/nonexistent/x.txt", "--out", "OUT"], "input not found"),
    (["summarize", "IN", "--out", "OUT", "--chunk-tokens", "100000"], "--chunk-tokens"),
    (["summarize", "IN", "--out", "OUT", "--context", "128"], "too small"),
    (["summarize", "IN", "--out", "OUT", "--summary-tokens", "2"], "--summary-tokens"),
])
def test_cli_user_errors_are_one_line(tmp_path, capsys, argv, message):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "d.txt").write_text("Some text. " * 20)
    argv = [a.replace("IN", str(tmp_path / "in")).replace("OUT", str(tmp_path / "out")) for a in argv]
    code = cli.main(argv + ["--backend", "fake", "--json"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and "\n" not in err and "Traceback" not in err
