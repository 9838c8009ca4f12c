"""One invariant of serve's batching stream sources, on torch (a tiny random-weight GGUF) and
llama.cpp (the bundled SmolLM2): a request that fails — at sampler construction, tokenization,
prefill, any decode step's event or sampling — fails only its own stream, and every slot is free
afterwards; a neighbouring stream decoding beside it finishes intact, and the source serves the
next request. A forward that several streams share fails each of them and nothing else. Prompts
prefill a chunk per step between the others' decode steps (a long prompt delays a neighbour by
one chunk a step: counted, and on llama.cpp timed against the whole prefill in CPU seconds of
this process, which a busy machine's preemption does not stretch), and a stream cancelled during
its prefill stops at the next chunk."""
from __future__ import annotations


import pytest
import torch

from localctx.app.session_options import SessionRequest, open_session
from localctx.backends.base import GenerationParams
from localctx.backends.generation.stream_source import StreamFailed
from localctx.backends.llamacpp import serving as llama_serving
from localctx.backends.llamacpp.serving import LlamaSlots
from localctx.backends.models.ref import ModelRef
from localctx.backends.torch import serving as torch_serving
from localctx.backends.torch import session as torch_session
from localctx.backends.torch.loading import TorchOptions, build_session, load_model
from localctx.backends.torch.serving import SlotBatcher
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from torch_tiny_models import TinyConfig, tiny_weights, write_gguf

OPTIONS = TorchOptions(device="cpu", dtype=torch.float32, block_size=8)
NEIGHBOUR = [{"role": "user", "content": "Count: one, two,"}]
VICTIM = [{"role": "user", "content": "Name a fruit."}]
VICTIM_SEED = 4242  # marks the victim's params
N_PARAMS = GenerationParams(max_tokens=12, ignore_eos=True)
V_PARAMS = GenerationParams(max_tokens=12, ignore_eos=True, temperature=0.7, seed=VICTIM_SEED)
FAULTS = ["sampler", "tokenize", "prefill", "event 1", "event 3", "sample 1", "sample 3"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = TinyConfig()
    path = write_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", cfg, tiny_weights(cfg, seed=11))
    return load_model(ModelRef("gguf", path, "tiny", "file"), OPTIONS)


@pytest.fixture(scope="module")
def smollm2():
    session = open_session(SessionRequest(model=None, backend="llamacpp", kv="fp16", context=2048))
    yield session
    session.close()


@pytest.fixture(params=["torch", pytest.param("llamacpp", marks=pytest.mark.slow)])
def backend(request):
    """(name, a factory of fresh two-slot sources); the sources are closed afterwards."""
    made = []
    if request.param == "torch":
        loaded = request.getfixturevalue("tiny")

        def make():
            return SlotBatcher(build_session(loaded, Plan.fixed("torch", loaded.spec, KVPolicy.parse("fp16"), 480),
                                             OPTIONS), 2)
    else:
        session = request.getfixturevalue("smollm2")

        def make():
            made.append(LlamaSlots(session, 2))
            return made[-1]
    yield request.param, make
    for source in made:
        source.close()


def is_victim(params) -> bool:
    return params.seed == VICTIM_SEED


def arm(fault: str, name: str, source, victim, monkeypatch) -> None:
    """Breaks the victim at ``fault``: before it starts (victim None) or after."""
    serving = torch_serving if name == "torch" else llama_serving
    if fault == "sampler" and victim is None:  # torch: the session builds it (with its grammar); llama.cpp: the chain
        owner, attr = (source.session, "sampler") if name == "torch" else (llama_serving, "sampler_chain")
        real = getattr(owner, attr)

        def broken(params, *model):
            if is_victim(params):
                raise OverflowError("a seed the sampler cannot take")
            return real(params, *model)
        monkeypatch.setattr(owner, attr, broken)
    elif fault == "tokenize" and victim is None:
        real_tokenize = source.session.tokenize
        monkeypatch.setattr(source.session, "tokenize",
                            lambda p: (_ for _ in ()).throw(ValueError("untokenizable")) if p is VICTIM
                            else real_tokenize(p))
    elif fault == "prefill" and victim is not None:
        if name == "torch":
            real_prefill = source.engine.prefill_together

            def prefill(seq_ids, token_lists):
                if victim.slot.seq_id in seq_ids:
                    raise RuntimeError("the prefill broke")
                return real_prefill(seq_ids, token_lists)
            monkeypatch.setattr(source.engine, "prefill_together", prefill)
        else:
            real_decode = source.decoder.decode

            def decode(entries):
                if any(seq is victim.seq and pos < len(seq.prompt) - 1 for seq, _, pos, _ in entries):
                    raise RuntimeError("the prefill broke")
                return real_decode(entries)
            monkeypatch.setattr(source.decoder, "decode", decode)
    elif fault.startswith("event") and victim is None:
        k, real_stream = int(fault.split()[1]), serving.stream

        def stream(tokens, *, params, **kw):
            events = real_stream(tokens, params=params, **kw)
            if not is_victim(params):
                return events

            def failing():
                for i, event in enumerate(events, 1):
                    if i == k:
                        raise UnicodeError("this stream's text broke")
                    yield event
            return failing()
        monkeypatch.setattr(serving, "stream", stream)
    elif fault.startswith("sample") and victim is None and name == "torch":
        k, real_sampler = int(fault.split()[1]), torch_session.Sampler  # TorchSession.sampler builds it

        class Sampler(real_sampler):
            calls = 0

            def sample(self, logits):
                self.calls += 1
                if is_victim(self.params) and self.calls == k:
                    raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
                return super().sample(logits)
        monkeypatch.setattr(torch_session, "Sampler", Sampler)
    elif fault.startswith("sample") and victim is not None and name == "llamacpp":
        k, lib = int(fault.split()[1]), source.llama_cpp
        real_sample, calls = lib.llama_sampler_sample, []

        def sample(sampler, ctx, j):
            if sampler is victim.seq.sampler:
                calls.append(j)
                if len(calls) == k:
                    raise RuntimeError("the sampler broke")
            return real_sample(sampler, ctx, j)
        monkeypatch.setattr(lib, "llama_sampler_sample", sample)


def drain(source, started: list, limit: int = 2000) -> dict:
    """Steps until nothing is live; per stream (tokens, its done event or StreamFailed)."""
    out = {id(s): ([], None) for s in started}
    for _ in range(limit):
        if not source.active:
            return out
        for s, e in source.step():
            tokens, end = out.setdefault(id(s), ([], None))
            if isinstance(e, StreamFailed) or e.kind == "done":
                out[id(s)] = (tokens, e)
            else:
                tokens.append(e.token)
    raise AssertionError("the source never finished")


def alone(make, prompt, params) -> list[int]:
    source = make()
    stream, _ = source.start(prompt, params, None)
    tokens, done = drain(source, [stream])[id(stream)]
    assert done.kind == "done"
    return tokens


def all_free(source) -> bool:
    return source.active == 0 and not any(slot.busy for slot in source.slots)


@pytest.mark.parametrize("fault", FAULTS)
def test_a_failure_at_any_step_fails_only_its_own_stream_and_every_slot_comes_back(backend, fault, monkeypatch):
    name, make = backend
    reference = alone(make, NEIGHBOUR, N_PARAMS)
    source = make()
    neighbour, _ = source.start(NEIGHBOUR, N_PARAMS, None)
    got = []
    while len(got) < 2:  # the neighbour is decoding before the victim comes
        got += [e.token for s, e in source.step() if s is neighbour and e.kind == "token"]
    arm(fault, name, source, None, monkeypatch)
    victim, failed_at_start = None, None
    try:
        victim, _ = source.start(VICTIM, V_PARAMS, None)
    except Exception as exc:  # noqa: BLE001 - what the scheduler answers with a 500
        failed_at_start = exc
    if victim is not None:
        arm(fault, name, source, victim, monkeypatch)
    ends = drain(source, [neighbour] + ([victim] if victim else []))
    monkeypatch.undo()
    if fault in ("sampler", "tokenize"):
        assert failed_at_start is not None and victim is None
    else:
        assert failed_at_start is None and isinstance(ends[id(victim)][1], StreamFailed), ends[id(victim)]
    tokens, done = ends[id(neighbour)]
    tokens = got + tokens
    assert done.kind == "done" and done.finish_reason == "length" and len(tokens) == 12
    if name == "torch":
        assert tokens == reference  # batched beside a failing stream, token for token as alone
    else:
        assert tokens[0] == reference[0]  # llama.cpp's batched floats may differ in later digits
    assert all_free(source)
    greedy = GenerationParams(max_tokens=6, ignore_eos=True)
    stream, _ = source.start(VICTIM, greedy, None)  # the next request is served at once
    tokens, done = drain(source, [stream])[id(stream)]
    assert done.kind == "done" and len(tokens) == 6 and all_free(source)
    if name == "torch":
        assert tokens == alone(make, VICTIM, greedy)


def test_a_forward_the_streams_share_fails_each_of_them_and_nothing_else(backend, monkeypatch):
    name, make = backend
    source = make()
    started = [source.start(p, N_PARAMS, None)[0] for p in (NEIGHBOUR, VICTIM)]
    while not all(s.events is not None for s in started):
        source.step()  # both prefilled: the next step decodes them in one forward
    target, attr = (source.engine, "decode") if name == "torch" else (source.decoder, "decode")
    real = getattr(target, attr)
    calls = []

    def broken(*args):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("the shared forward broke")
        return real(*args)
    monkeypatch.setattr(target, attr, broken)
    ends = drain(source, started)
    assert all(isinstance(ends[id(s)][1], StreamFailed) for s in started) and all_free(source)
    stream, _ = source.start(NEIGHBOUR, GenerationParams(max_tokens=4, ignore_eos=True), None)
    tokens, done = drain(source, [stream])[id(stream)]
    assert done.kind == "done" and len(tokens) == 4 and all_free(source)


def long_prompt(name: str) -> list[dict]:
    words = "the cache keeps recent tokens while sinks hold the start " * (6 if name == "torch" else 40)
    return [{"role": "user", "content": words}]


def test_a_long_prompt_prefills_a_chunk_per_step_between_the_neighbours_tokens(backend):
    name, make = backend
    chunk = 16 if name == "torch" else 64
    prompt = long_prompt(name)
    greedy = GenerationParams(max_tokens=4)
    source = make()
    n_prompt = len(source.tokenize(prompt))
    assert n_prompt > 6 * chunk
    whole = make()  # the same prompt's prefill in one piece, beside nothing, for the time it takes
    whole.prefill_chunk = 10 ** 6
    stream, _ = whole.start(prompt, greedy, None)
    (_, first_whole), = whole.step()
    reference = [first_whole.token]  # greedy: a chunked prefill's first token is the same
    whole.cancel_all()

    source.prefill_chunk = chunk
    room = 60 if name == "torch" else 300  # the torch pool holds both streams' worst case at once
    neighbour, _ = source.start(NEIGHBOUR, GenerationParams(max_tokens=room, ignore_eos=True), None)
    while neighbour.events is None:
        source.step()
    long, _ = source.start(prompt, greedy, None, ids=source.tokenize(prompt))
    neighbour_events, first_long = [], None
    while first_long is None:
        for s, e in source.step():
            if s is neighbour:
                neighbour_events.append(e)
            elif s is long:
                first_long = e
    assert first_long.kind == "token"
    assert max(source.prefill_steps) <= chunk  # never more than one chunk of prompt in a step
    assert len(neighbour_events) >= n_prompt // chunk - 1  # the neighbour got a token in every step the prompt prefilled
    # each step between two of the neighbour's tokens prefilled at most one chunk (above) and the prompt
    # took several steps: the delay is counted in tokens, not timed (CPU time includes llama.cpp's
    # spinning threads, which a loaded host inflates without bound)
    assert sum(source.prefill_steps) >= n_prompt - chunk and len(source.prefill_steps) >= n_prompt // chunk
    assert first_long.token == reference[0]
    source.cancel_all()
    assert all_free(source)


def test_a_stream_cancelled_during_its_prefill_stops_at_the_next_chunk(backend):
    import threading

    name, make = backend
    source = make()
    source.prefill_chunk = 16
    prompt = long_prompt(name)
    cancel = threading.Event()
    stream, _ = source.start(prompt, GenerationParams(max_tokens=8), cancel)
    assert source.step() == []  # one chunk of its prompt, no event yet
    cancel.set()
    (s, done), = source.step()
    assert s is stream and done.kind == "done" and done.finish_reason == "cancelled"
    assert source.prefill_steps == [16] and all_free(source)  # the rest of the prompt was never prefilled
