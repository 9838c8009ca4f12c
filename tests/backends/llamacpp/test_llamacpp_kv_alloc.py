"""Our count of llama.cpp's KV allocation equals llama.cpp's own report, per architecture, at three
context lengths: tiny random-weight GGUFs (llama, qwen2, qwen3, gemma3, gemma2 with alternating
windows, qwen3moe), loaded by llama.cpp in a child process with its log on. K and V types apart
too, and what ``plan --json`` and ``run --json`` print for a llama.cpp plan."""
import json

import pytest
from gguf_tiny import ARCHS, write

pytest.importorskip("llama_cpp")

from localctx.backends.llamacpp.allocation import LlamaCppCache, row_bytes  # noqa: E402
from localctx.backends.llamacpp.allocation_report import MiB, reported_caches  # noqa: E402
from localctx.backends.llamacpp.shift import local_calibration, settings_for_policy  # noqa: E402
from localctx.backends.models.spec_reader import gguf_spec  # noqa: E402
from localctx.kvcache.policy import KVPolicy  # noqa: E402

CONTEXTS = (1000, 4096, 20000)  # 1000 pads to 1,024 cells; 20,000 is past the tiny models' trained 8,192


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kv-ggufs")
    return {name: write(folder / f"{name}.gguf", cfg) for name, cfg in ARCHS.items()}


def assert_matches(spec, settings: LlamaCppCache, reported) -> None:
    ours = settings.caches(spec)
    assert [(c.cells, c.layers) for c in ours] == [(r.cells, r.layers) for r in reported], (settings, reported)
    half = 0.005 + 1e-9  # llama.cpp prints MiB with two decimals
    for c, r in zip(ours, reported):
        assert abs(c.k_bytes / MiB - r.k_mib) <= half and abs(c.v_bytes / MiB - r.v_mib) <= half, (c, r)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_kv_bytes_equal_llama_cpp_allocation_at_three_contexts(ggufs, arch):
    spec = gguf_spec(ggufs[arch])
    settings = [LlamaCppCache(n_ctx=c, swa_full=False) for c in CONTEXTS]
    for s, reported in zip(settings, reported_caches(ggufs[arch], settings)):
        assert_matches(spec, s, reported)


def test_sliding_layers_compact_unless_full_size_and_quantized_rows(ggufs):
    spec = gguf_spec(ggufs["gemma3"])
    settings = [LlamaCppCache(n_ctx=20000, swa_full=True),
                LlamaCppCache(n_ctx=20000, type_k="q8_0", type_v="q8_0", flash_attn=True, swa_full=False),
                LlamaCppCache(n_ctx=300, swa_full=False)]
    reported = reported_caches(ggufs["gemma3"], settings)
    for s, r in zip(settings, reported):
        assert_matches(spec, s, r)
    full, compact = settings[0].caches(spec), settings[1].caches(spec)
    assert full[1].cells == 20224 and compact[1].cells == 1024  # 512-token window + 512 ubatch, padded to 256
    assert settings[2].caches(spec)[1].cells == 512  # the SWA cache never exceeds the context


SPLIT_TYPES = (("f16", "q8_0"), ("f16", "q4_0"), ("q8_0", "q4_0"))


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_keys_and_values_in_their_own_types_equal_llama_cpp_allocation(ggufs, arch):
    spec = gguf_spec(ggufs[arch])
    settings = [LlamaCppCache(n_ctx=c, type_k=k, type_v=v, flash_attn=True, swa_full=False)
                for c in (1000, 8192) for k, v in SPLIT_TYPES]
    for s, reported in zip(settings, reported_caches(ggufs[arch], settings)):
        assert_matches(spec, s, reported)
    k8v4 = settings[2].caches(spec)[0]
    assert k8v4.k_bytes == k8v4.v_bytes * 34 // 18  # q8_0 blocks of 34 bytes, q4_0 of 18, same cells and widths


@pytest.mark.parametrize("kv, types", [("int8", "q8_0 keys and values"), ("k8v4", "q8_0 keys, q4_0 values"),
                                       ("kf16v4", "f16 keys, q4_0 values")])
def test_plan_and_run_json_print_llama_cpp_allocation_and_layout(ggufs, cli, kv, types):
    """At 1,024 and 8,192 tokens and at 1,000 (not a multiple of 256: llama.cpp pads to 1,024 cells)."""
    path, policy = ggufs["qwen3"], KVPolicy.parse(kv)
    spec = gguf_spec(path)
    contexts = (1024, 8192, 1000)
    plans = []
    for c in contexts:
        res = cli("plan", "-m", str(path), "--backend", "llamacpp", "--kv", kv, "--context", str(c), "--json")
        assert res.code == 0, res.err
        plans.append(json.loads(res.out)["plan"])
    settings = [settings_for_policy(policy, c, local_calibration()).cache() for c in contexts]
    for plan, s, reported in zip(plans, settings, reported_caches(path, settings)):
        assert_matches(spec, s, reported)
        assert plan["kv_bytes"] == s.bytes(spec)
        assert plan["kv_layout"].startswith(f"lossy: {types}") and "padded to a multiple of 256 cells" in plan["kv_layout"]
        assert "full precision)" not in plan["kv_layout"]  # not the policy cache's head group and residual
    assert plans[2]["kv_bytes"] == plans[0]["kv_bytes"]  # 1,000 tokens take 1,024 cells
    res = cli("run", "-m", str(path), "--backend", "llamacpp", "--kv", kv, "--context", "1000", "--max-tokens", "1",
              "--raw", "--json", "hello")
    assert res.code == 0, res.err
    out = json.loads(res.out)
    assert out["planned_kv_bytes"] == plans[2]["kv_bytes"] and out["kv_layout"] == plans[2]["kv_layout"]


def test_row_sizes_match_ggml():
    from localctx.backends.llamacpp.session import ggml_row_size
    import llama_cpp

    for name in ("f16", "q8_0", "q4_0"):
        for n in (32, 64, 256, 1024):
            assert row_bytes(name, n) == ggml_row_size(getattr(llama_cpp, f"GGML_TYPE_{name.upper()}"), n)
