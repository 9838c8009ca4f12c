import pytest

from localctx.kvcache.errors import UserError
from localctx.kvcache.eviction import policy_cache_layout
from localctx.kvcache.policy import KVPolicy


@pytest.mark.parametrize("text", ["fp16", "int8", "int4+res128", "int4+sink4+win4096",
                                  "int8+sink4+win2048+heavy256", "int4+g64+res64+sink4+win512+heavy32",
                                  "fp16+sink4+win1024", "fp16+win100", "k8v4", "kf16v8", "kf16v4", "k4v8",
                                  "k8vf16", "k8v4+g64+res128", "kf16v4+res64+sink4+win1024+heavy64"])
def test_text_round_trips(text):
    policy = KVPolicy.parse(text)
    assert str(policy) == text
    assert KVPolicy.parse(str(policy)) == policy


def test_parse_reads_every_field_in_any_order():
    p = KVPolicy.parse("win4096+sink4+INT4+res128+g64+heavy16")
    assert (p.k_bits, p.v_bits, p.group_size, p.residual, p.sinks, p.window, p.heavy) == (4, 4, 64, 128, 4, 4096, 16)
    assert str(p) == "int4+g64+res128+sink4+win4096+heavy16"


@pytest.mark.parametrize("text, k, v, canonical", [
    ("k8v4", 8, 4, "k8v4"), ("kf16v8", 16, 8, "kf16v8"), ("k16v4", 16, 4, "kf16v4"), ("kfp16v4", 16, 4, "kf16v4"),
    ("k4v4", 4, 4, "int4"), ("k8v8+res64", 8, 8, "int8+res64"), ("kf16vf16", 16, 16, "fp16"),
    ("K8V4+sink4+win512", 8, 4, "k8v4+sink4+win512")])
def test_keys_and_values_take_their_own_precision(text, k, v, canonical):
    p = KVPolicy.parse(text)
    assert (p.k_bits, p.v_bits) == (k, v)
    assert str(p) == canonical and KVPolicy.parse(canonical) == p
    assert p.split == (k != v) and p.quantized == (min(k, v) < 16) and p.exact == (k == v == 16)


def test_a_split_with_one_full_side_is_quantized_and_takes_groups_and_a_residual():
    p = KVPolicy.parse("kf16v4+g64+res32")
    assert p.quantized and p.group_size == 64 and p.residual == 32
    assert KVPolicy.parse("int8") == KVPolicy(k_bits=8, v_bits=8)
    assert KVPolicy.parse("fp16") == KVPolicy()


def test_aliases_print_canonically():
    assert str(KVPolicy.parse("bf16")) == "fp16"
    assert str(KVPolicy.parse("q8")) == "int8"


@pytest.mark.parametrize("text, words", [
    ("", "empty"),
    ("int5", "unknown part 'int5'"),
    ("int4+int8", "two precisions"),
    ("int4+win0", "win0"),
    ("int4+g48", "group size"),
    ("fp16+res128", "residual"),
    ("fp16+g64", "group size only applies"),
    ("int4+sink4+sink8", "twice"),
    ("int4+window4096", "unknown part"),
    ("int8+heavy256", "without 'win' nothing is evicted"),
    ("k5v4", "each f16, 8 or 4"),
    ("k8vx", "e.g. k8v4"),
    ("k8v4+int8", "two precisions"),
    ("k8v4+kf16v4", "two precisions"),
    ("kf16vf16+res16", "residual"),
    ("kf16vf16+g64", "group size only applies"),
    ("fp16+sink4+heavy16", "add a window"),
])
def test_invalid_forms_are_refused_with_the_reason(text, words):
    with pytest.raises(UserError) as err:
        KVPolicy.parse(text)
    assert words in str(err.value)


@pytest.mark.parametrize("text, shown", [("int8+heavy8", "'int8+heavy8'"), ("fp16+res128", "'fp16+res128'"),
                                         ("int4+g32+sink4+heavy16", "'int4+sink4+heavy16'")])
def test_a_rule_across_parts_names_the_policy_as_written(text, shown):
    with pytest.raises(UserError) as err:
        KVPolicy.parse(text)
    assert f"invalid KV policy {shown}:" in str(err.value) and "k_bits=" not in str(err.value)


def test_heavy_hitters_without_a_window_are_refused_when_built_directly_too():
    with pytest.raises(UserError, match="drop 'heavy'"):
        KVPolicy(k_bits=8, v_bits=8, heavy=64)
    assert KVPolicy(k_bits=8, v_bits=8, sinks=4, window=512, heavy=64).capacity() == 580


def test_bad_bits_built_directly_name_the_fix():
    with pytest.raises(UserError, match="k8v4"):
        KVPolicy(k_bits=8, v_bits=2)


def test_exactness_and_capacity():
    assert KVPolicy.parse("fp16").exact
    assert not KVPolicy.parse("int8").exact
    lossy = KVPolicy.parse("fp16+sink4+win1024+heavy100")
    assert not lossy.exact and lossy.capacity() == 1128
    assert lossy.kept_tokens(500) == 500 and lossy.kept_tokens(50_000) == 1128
    assert KVPolicy.parse("int4").capacity() is None


def test_the_policy_cache_layout_says_which_tokens_a_quantized_cache_keeps_exact():
    assert policy_cache_layout(KVPolicy.parse("int4+res128")) == \
        "lossy: 4-bit KV (groups of 32, first 32 and last 128 tokens full precision)"
    assert policy_cache_layout(KVPolicy.parse("int8+g64")) == \
        "lossy: 8-bit KV (groups of 64, first 64 tokens full precision)"
    assert policy_cache_layout(KVPolicy.parse("int4+sink4+win1024")) == \
        "lossy: 4-bit KV (groups of 32), keeps first 4 + last 1024 tokens"  # with a window the sinks keep the head
    assert policy_cache_layout(KVPolicy.parse("kf16v4+res64")) == \
        "lossy: full-precision keys, 4-bit values (groups of 32, first 32 and last 64 tokens full precision)"
    assert policy_cache_layout(KVPolicy.parse("k8v4")) == \
        "lossy: 8-bit keys, 4-bit values (groups of 32, first 32 tokens full precision)"
    assert policy_cache_layout(KVPolicy.parse("fp16")) == "exact: full-precision KV"
