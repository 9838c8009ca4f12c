"""The long-context tasks' generators (backends/evaluation/long_tasks.py): deterministic from the
seed, the answer is in the text, distractors differ from it, prompts fit their length, scoring is
exact substring match; `eval --tasks` refuses bad input in one line."""
import re
from collections import Counter

import pytest

from localctx.app.cli import main
from localctx.backends.evaluation import long_tasks as lt


class WordEncoder:
    """A stand-in tokenizer: one id per word or punctuation mark (lengths are what matter here)."""

    def encode(self, text: str) -> list[int]:
        return [hash(t) % 50000 for t in re.findall(r"\w+|[^\w\s]", text)]


ENC = WordEncoder()


def one(task: str, length: int = 2048, seed: int = 0, index: int = 0) -> lt.Sample:
    suite = lt.TaskSuite((task,), (length,), samples=index + 1, seed=seed)
    return list(lt.samples(ENC, suite))[index]


@pytest.mark.parametrize("task", lt.TASKS)
@pytest.mark.parametrize("length", [1024, 4096])
def test_prompts_fit_their_length_and_fill_most_of_it(task, length):
    s = one(task, length)
    assert s.ids == ENC.encode(s.text)
    assert 0.9 * length <= len(s.ids) <= length


@pytest.mark.parametrize("task", lt.TASKS)
def test_the_same_seed_gives_the_same_sample_and_another_seed_another(task):
    a, b, c = one(task), one(task), one(task, seed=1)
    assert a.text == b.text and a.expected == b.expected
    assert c.expected != a.expected
    # a sample does not depend on how many others are drawn
    assert one(task, index=1).text != a.text
    assert list(lt.samples(ENC, lt.TaskSuite((task,), (2048,), samples=3)))[0].text == a.text


def test_multikey_states_the_asked_value_once_beside_distractor_keys_with_other_values():
    s = one("niah_multikey")
    (value,) = s.expected
    asked = re.search(r"special magic number for (\S+) mentioned", s.text).group(1)
    needles = dict(re.findall(r"One of the special magic numbers for (\S+) is: (\d+)\.", s.text))
    assert len(needles) == 4 and needles[asked] == value
    assert s.text.count(value) == 1
    assert len(set(needles.values())) == 4  # every distractor has its own number


def test_multivalue_states_every_value_for_one_key():
    s = one("niah_multivalue")
    found = re.findall(r"One of the special magic numbers for (\S+) is: (\d+)\.", s.text)
    assert len({k for k, _ in found}) == 1
    assert tuple(v for _, v in found) == s.expected and len(set(s.expected)) == 4


def test_variable_tracking_chain_leads_from_the_value_and_the_distractor_chain_from_another():
    s = one("vt")
    value = re.search(r"assigned the value (\d+) in the text", s.text).group(1)
    assigned = dict(re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", s.text))
    assert len(assigned) == 10

    def root(name):
        while assigned[name].startswith("VAR "):
            name = assigned[name][4:]
        return assigned[name]

    assert sorted(n for n in assigned if root(n) == value) == sorted(s.expected)
    others = {root(n) for n in assigned if n not in s.expected}
    assert others and value not in others


def test_common_words_occur_far_more_often_than_every_other_word():
    for length in (1024, 4096):
        s = one("cwe", length)
        counts = Counter(re.findall(r"^\d+\. (\w+)$", s.text, flags=re.M))
        common = {w: counts[w] for w in s.expected}
        rare = [n for w, n in counts.items() if w not in s.expected]
        assert min(common.values()) >= 8 and max(rare) == 3 and len(rare) > 20


def test_scoring_is_exact_substring_match_per_expected_string():
    assert lt.score(" 1234567.", ("1234567",)) == 1.0
    assert lt.score(" 123456", ("1234567",)) == 0.0
    assert lt.score("AAAAA, BBBBB and CCCCC", ("AAAAA", "BBBBB", "DDDDD", "CCCCC")) == 0.75
    result = lt.run([one("niah_multikey", 1024)], lambda ids, n: f" {one('niah_multikey', 1024).expected[0]}.")
    assert result.rows[0]["hit"] and result.summary() == [
        {"task": "niah_multikey", "length": 1024, "samples": 1, "hits": 1, "score": 1.0}]


def test_a_length_too_short_for_the_task_is_a_user_error():
    with pytest.raises(lt.UserError, match="give longer --lengths"):
        one("cwe", 64)


@pytest.mark.parametrize("argv,message", [
    (["--tasks", "niah,vt"], "--tasks niah: unknown; choose from niah_multikey,niah_multivalue,vt,cwe"),
    (["--tasks", "vt", "--lengths", "100"], "--lengths must be at least 256"),
    (["--tasks", "vt", "--lengths", "2k"], "comma-separated numbers"),
    (["--tasks", "vt", "--samples", "0"], "--samples 0 must be at least 1"),
    (["--no-perplexity", "--no-needle"], "drop one or give --tasks"),
])
def test_bad_tasks_input_is_one_line_and_exit_2(argv, message, capsys):
    assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
