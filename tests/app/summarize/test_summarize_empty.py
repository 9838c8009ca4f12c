"""A document whose summary comes out empty (a base model that starts a new question at once, found with
Gemma 3 270M) is not written as an empty file and called done: the report marks it "empty" with why,
the batch exits 4, and a later run tries it again; an empty chunk summary inside a longer document is
counted in its record."""
from __future__ import annotations

from localctx.app.summarize.executor import EMPTY_REASON
from localctx.app.summarize.pipeline import EXIT_SOME_EMPTY
from summarize_helpers import fake_session, outputs, run, topics_text

MUTE = "SAY NOTHING"


def muted_session(context: int = 1024):
    """The fake session, answering nothing (end of generation at once) to a prompt that holds MUTE."""
    session = fake_session(context)
    reply = session._reply

    def quiet(prompt, params):
        words, n_answer = reply(prompt, params)
        text = prompt if isinstance(prompt, str) else " ".join(m["content"] for m in prompt)
        return words, (0 if MUTE in text else n_answer)

    session._reply = quiet
    return session


def test_an_empty_summary_is_reported_not_written_and_tried_again(tmp_path):
    docs, out = tmp_path / "docs", tmp_path / "out"
    docs.mkdir()
    (docs / "ok.txt").write_text("A short note about caches and what they keep.\n")
    (docs / "mute.txt").write_text(f"{MUTE}. A note the model will not summarise.\n")
    report, events = run([docs], out, session=muted_session())
    assert report["counts"]["done"] == 1 and report["counts"]["empty"] == 1
    assert report["exit_code"] == EXIT_SOME_EMPTY == 4 and events[-1]["exit_code"] == 4
    record = next(r for r in report["documents"] if r["path"] == "mute.txt")
    assert record["status"] == "empty" and record["reason"] == EMPTY_REASON and "output" not in record
    assert list(outputs(out)) == ["ok.txt.summary.md"] and outputs(out)["ok.txt.summary.md"].strip()
    again, _ = run([docs], out, session=muted_session())  # the empty one is tried again, the other is kept
    status = {r["path"]: r["status"] for r in again["documents"]}
    assert status == {"ok.txt": "unchanged", "mute.txt": "empty"}
    (docs / "mute.txt").write_text("Now a note the model does summarise.\n")
    third, _ = run([docs], out, session=muted_session())
    assert third["exit_code"] == 0 and {r["path"]: r["status"] for r in third["documents"]}["mute.txt"] == "done"


def test_an_empty_chunk_summary_is_counted_in_its_document(tmp_path):
    docs, out = tmp_path / "docs", tmp_path / "out"
    docs.mkdir()
    (docs / "long.txt").write_text(topics_text(0, 6) + f"\n\n{MUTE}\n\n" + topics_text(6, 6))
    report, _ = run([docs], out, session=muted_session(600))
    record = report["documents"][0]
    assert record["status"] == "done" and record["chunks"] > 2
    assert 1 <= record["empty_answers"] < record["calls"]  # the chunk that held MUTE, and nothing above it
