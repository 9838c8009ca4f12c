"""``localctx eval``: bad input is one line and exit 2 before any model loads; on the real model a
tiny run prints the table / JSON with the full-precision cache beside each policy."""
import json

import pytest

from localctx.app.cli import main


@pytest.mark.parametrize("argv,message", [
    (["--kv", "int3"], "unknown part"),
    (["--no-perplexity", "--no-needle"], "nothing to measure"),
    (["--tokens", "10"], "at least 64"),
    (["--score-from", "9000"], "inside the 8192 tokens"),
    (["--needle-lengths", "1k"], "comma-separated numbers"),
    (["--needle-lengths", "64"], "at least 128"),
    (["--needle-depths", "1.5"], "lie in [0, 1]"),
    (["--no-baseline"], "give --kv POLICY"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.slow
def test_a_tiny_real_run_reports_each_policy_beside_full_precision(capsys, monkeypatch):
    monkeypatch.setenv("LOCALCTX_TORCH_DEVICE", "cpu")
    code = main(["eval", "--kv", "int8", "--kv", "fp16+sink4+win64", "--tokens", "96", "--chunk", "32",
                 "--needle-lengths", "160", "--needle-depths", "0.5", "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    rows = {p["policy"]: p for p in data["policies"]}
    assert list(rows) == ["fp16", "int8", "fp16+sink4+win64"]
    assert rows["fp16"]["exact"] and not rows["int8"]["exact"]
    base = rows["fp16"]["perplexity"]["ppl"]
    assert 1 < base < 1000
    assert abs(rows["int8"]["perplexity"]["ppl"] / base - 1) < 0.02  # int8 KV barely moves perplexity
    full_token = rows["fp16"]["perplexity"]["kv_bytes"] // 95  # 95 tokens held, fp32 here
    elems = full_token // 4
    # 95 tokens: group 1 (tokens 32..63) quantized at 8 bits + a scale and min per 32; the head
    # (tokens 0..31) and tokens 64..94 in full precision
    assert rows["int8"]["perplexity"]["kv_bytes"] == 32 * (elems + elems // 32 * 4) + 63 * full_token
    assert rows["fp16+sink4+win64"]["perplexity"]["kv_tokens"] == 4 + 64
    assert rows["fp16"]["needle"]["grid"][0]["hit"]  # the model finds a key 160 tokens back
