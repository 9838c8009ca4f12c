"""Model references through the Hugging Face cache, `localctx models`, `localctx pull` offline."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from localctx.backends.models.ref import resolve
from localctx.kvcache.errors import UserError


def _cache_repo(hf_home, repo, files):
    """Lay out a repo the way huggingface-hub caches it: blobs, a snapshot, refs/main."""
    base = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    snap = base / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snap.mkdir(parents=True)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(snap.name)
    for name, src in files.items():
        os.symlink(src, snap / name)
    return snap


def test_cached_repo_resolves_to_its_gguf(isolated_user_dirs, smollm2_path):
    snap = _cache_repo(isolated_user_dirs / "hf", "someone/smol-gguf", {"smol.Q4_1.gguf": smollm2_path})
    ref = resolve("someone/smol-gguf")
    assert ref.kind == "gguf" and ref.source == "hub-cache" and ref.path == snap / "smol.Q4_1.gguf"


def test_repo_with_several_ggufs_asks_which(isolated_user_dirs, smollm2_path):
    _cache_repo(isolated_user_dirs / "hf", "someone/many", {"a.Q4_1.gguf": smollm2_path, "a.Q8_0.gguf": smollm2_path})
    with pytest.raises(UserError, match="several GGUF files"):
        resolve("someone/many")
    assert resolve("someone/many:Q8_0").path.name == "a.Q8_0.gguf"


def test_models_lists_bundled_and_cached_with_shape(cli, isolated_user_dirs, smollm2_path):
    _cache_repo(isolated_user_dirs / "hf", "someone/smol-gguf", {"smol.gguf": smollm2_path})
    res = cli("models", "--json")
    assert res.code == 0
    rows = json.loads(res.out)
    sources = {r["source"] for r in rows}
    assert {"bundled", "hub-cache"} <= sources
    for r in rows:
        assert r["architecture"] == "llama" and r["context_length"] == 8192
        assert r["size_bytes"] == smollm2_path.stat().st_size
    table = cli("models").out
    assert "SmolLM2-135M-Instruct (default)" in table and "8,192" in table


def test_pull_says_plainly_when_the_hub_cannot_be_reached(cli):
    res = cli("pull", "someone/anything")
    assert res.code == 1
    assert "cannot be reached" in res.err and "Traceback" not in res.err


def test_pull_rejects_a_non_repo_id(cli):
    res = cli("pull", "justaname")
    assert res.code == 2 and "OWNER/NAME" in res.err


# the fake answers 12 + len(prompt) % 20 words: 31 here, 9.3 s at 0.3 s a word, so Ctrl-C half a
# second into the answer lands mid-stream even when a loaded machine delays this test's process
ANSWER_31_WORDS = "a long answer, please: each last word!!"


def test_ctrl_c_stops_cleanly_and_keeps_what_was_generated():
    env = dict(os.environ, LOCALCTX_FAKE_DELAY="0.3", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "localctx.app.cli", "run", "--backend", "fake",
                             "--max-tokens", "400", ANSWER_31_WORDS], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # a suite started in the background (`cmd &`) inherits SIGINT ignored,
                            # and Python then keeps it ignored: the child gets the default back
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = proc.stdout.read(7)  # blocks until the answer has started streaming
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    out = first + out
    assert proc.returncode == 130, err
    assert out.startswith("Reply: a")
    assert len(out.split()) < 31  # stopped before the fake's full 31-word answer
    assert "Traceback" not in err and "finish cancelled" in err
