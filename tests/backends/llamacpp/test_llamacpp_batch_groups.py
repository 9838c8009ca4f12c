"""How a batch of prompts is split into llama.cpp contexts: one KV stream per sequence, each as
large as its group's longest prompt plus answer, and no group over the plan's context."""
from localctx.backends.llamacpp.batch import MAX_SEQUENCES, prompt_groups, stream_cells


def test_each_group_fits_the_context_with_one_equal_stream_per_sequence():
    lengths = [1900, 1800, 1700, 1900, 300, 2500, 100, 1900]
    groups = prompt_groups(lengths, max_tokens=128, n_ctx=8192)
    assert [i for g in groups for i in g] == list(range(len(lengths)))  # every prompt once, in order
    for g in groups:
        assert len(g) * stream_cells(max(lengths[i] + 128 for i in g)) <= 8192
    assert groups[0] == [0, 1, 2, 3]  # four streams of 2,048 cells fill 8,192 exactly


def test_a_long_prompt_gets_a_group_of_its_own_and_groups_are_capped():
    assert prompt_groups([7000, 100], max_tokens=128, n_ctx=8192) == [[0], [1]]
    assert stream_cells(1) == 256 and stream_cells(257) == 512
    many = prompt_groups([10] * (MAX_SEQUENCES + 1), max_tokens=10, n_ctx=1 << 20)
    assert [len(g) for g in many] == [MAX_SEQUENCES, 1]
