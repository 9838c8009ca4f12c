import threading

from localctx.backends.base import GenerationParams, StatsClock
from localctx.backends.generation.decode_loop import KVProbe, StopMatcher, stream

PIECES = ["Hel", "lo", " wor", "ld", "!", " Bye"]


def run(tokens, params, cancel=None, pieces=PIECES, eos=frozenset({99})):
    clock = StatsClock(backend="t", policy="fp16", prompt_tokens=3)
    events = list(stream(iter(tokens), token_bytes=lambda t: pieces[t].encode(), eos=eos, params=params,
                         clock=clock, probe=KVProbe(lambda: (10, 3, 0)), cancel=cancel))
    return events, "".join(e.text for e in events)


def test_events_stream_in_order_and_end_with_one_done():
    events, text = run([0, 1, 2, 3, 99], GenerationParams(max_tokens=10))
    assert [e.kind for e in events] == ["token"] * 4 + ["done"]
    assert [e.stats.generated_tokens for e in events] == [1, 2, 3, 4, 4]
    assert text == "Hello world" and events[-1].finish_reason == "stop"


def test_max_tokens_is_honoured():
    events, text = run([0, 1, 2, 3, 4], GenerationParams(max_tokens=2))
    assert text == "Hello" and events[-1].finish_reason == "length"
    assert events[-1].stats.generated_tokens == 2


def test_stop_string_across_tokens_is_cut_and_never_shown():
    events, text = run([0, 1, 2, 3, 4, 5], GenerationParams(max_tokens=10, stop=("o wo",)))
    assert text == "Hell" and events[-1].finish_reason == "stop"
    assert all("o w" not in e.text for e in events)


def test_held_back_prefix_is_released_when_it_was_not_a_stop():
    events, text = run([0, 1, 2, 99], GenerationParams(max_tokens=10, stop=("worry",)))
    assert text == "Hello wor"


def test_cancel_between_tokens():
    cancel = threading.Event()

    def tokens():
        yield 0
        cancel.set()
        yield 1
        yield 2

    events, text = run(tokens(), GenerationParams(max_tokens=10), cancel=cancel)
    assert events[-1].finish_reason == "cancelled"
    assert text == "Hello"


def test_utf8_split_across_tokens_is_joined():
    pieces = ["é".encode()[:1].decode("latin-1"), ""]
    raw = ["caf".encode(), "é".encode()[:1], "é".encode()[1:]]
    clock = StatsClock(backend="t", policy="fp16", prompt_tokens=1)
    events = list(stream(iter([0, 1, 2]), token_bytes=lambda t: raw[t], eos=set(), params=GenerationParams(),
                         clock=clock, probe=KVProbe(lambda: (0, 0, 0))))
    assert "".join(e.text for e in events) == "café"
    assert events[1].text == "" and pieces


def test_source_can_return_its_finish_reason():
    def tokens():
        yield 0
        return "context"

    events, _ = run(tokens(), GenerationParams(max_tokens=10))
    assert events[-1].finish_reason == "context"


def test_stop_matcher_holds_only_possible_prefixes():
    m = StopMatcher(["</s>"])
    assert m.feed("abc<") == ("abc", False)
    assert m.feed("/") == ("", False)
    assert m.feed("x") == ("</x", False)
    assert m.feed("</s> tail") == ("", True)


def test_ignore_eos_goes_past_end_of_text_counting_it_but_showing_no_text():
    events, text = run([0, 1, 99, 2, 3, 4], GenerationParams(max_tokens=5, ignore_eos=True))
    assert text == "Hello world" and events[-1].finish_reason == "length"
    assert events[-1].stats.generated_tokens == 5
    assert [e.token for e in events if e.kind == "token"] == [0, 1, 99, 2, 3]
    plain, _ = run([0, 1, 99, 2, 3, 4], GenerationParams(max_tokens=5))
    assert plain[-1].finish_reason == "stop" and plain[-1].stats.generated_tokens == 2


def test_the_end_of_text_a_decode_step_made_counts_as_that_steps_output():
    """Prefill gives the first answer token; four decode forwards give three more and the end-of-text,
    so tokens per step and decode tok/s count four tokens for those four forwards and their time."""
    def tokens():
        for t in [0, 1, 2, 3, 99]:
            yield t
            clock.decode_steps += 1  # what the speculative loop counts: one forward per token here

    clock = StatsClock(backend="t", policy="fp16", prompt_tokens=3)
    events = list(stream(tokens(), token_bytes=lambda t: PIECES[t].encode(), eos={99},
                         params=GenerationParams(max_tokens=10), clock=clock, probe=KVProbe(lambda: (10, 3, 0))))
    done = events[-1].stats
    assert done.generated_tokens == 4 and done.stop_token == 1 and done.decode_steps == 4
    assert done.decoded_tokens == 4 and done.tokens_per_step == 1.0  # was 3 of 4: 0.75
    assert done.decode_tok_s == 4 / done.decode_s
    # a limit ends it: no end-of-text was made, the last forward's token is in the answer
    clock = StatsClock(backend="t", policy="fp16", prompt_tokens=3)
    events = list(stream(iter([0, 1, 2, 3, 99]), token_bytes=lambda t: PIECES[t].encode(), eos={99},
                         params=GenerationParams(max_tokens=3), clock=clock, probe=KVProbe(lambda: (10, 3, 0))))
    assert events[-1].stats.stop_token == 0 and events[-1].stats.decoded_tokens == 2
    # end-of-text straight out of prefill: no decode forward made anything
    clock = StatsClock(backend="t", policy="fp16", prompt_tokens=3)
    events = list(stream(iter([99]), token_bytes=lambda t: PIECES[t].encode(), eos={99},
                         params=GenerationParams(max_tokens=3), clock=clock, probe=KVProbe(lambda: (10, 3, 0))))
    assert events[-1].stats.stop_token == 0 and events[-1].stats.decoded_tokens == 0
