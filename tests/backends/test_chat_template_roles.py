"""Templates without a system role (Gemma 2's) take the system prompt in the first user turn, as
Gemma's own templates do; a GGUF without a template (a base model) gets a plain transcript."""
import pytest

from localctx.backends.base import GenerationParams, with_template_stops
from localctx.backends.models.chat_template import ChatTemplate, fold_system, gguf_template_source
from localctx.kvcache.errors import UserError

NO_SYSTEM = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
             "{% endif %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")


def test_a_template_that_refuses_the_system_role_gets_it_in_the_first_user_turn():
    t = ChatTemplate(NO_SYSTEM)
    out = t.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert out == "[user]Be brief.\n\nHi"


def test_without_a_system_message_the_refusal_stands():
    t = ChatTemplate("{{ raise_exception('no') }}")
    with pytest.raises(UserError, match="refused these messages: no"):
        t.render([{"role": "user", "content": "Hi"}])


def test_fold_system_keeps_later_turns_and_handles_a_lone_system_prompt():
    assert fold_system([{"role": "user", "content": "x"}]) is None
    assert fold_system([{"role": "system", "content": "s"}]) == [{"role": "user", "content": "s"}]


def test_a_gguf_without_a_template_is_continued_as_a_question_and_answer_transcript():
    t = ChatTemplate(gguf_template_source(None))
    text = t.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"},
                     {"role": "assistant", "content": "Light."}, {"role": "user", "content": "More"}])
    assert text == "Be brief.\n\nQuestion: Why?\nAnswer: Light.\nQuestion: More\nAnswer:"
    assert t.stops == ("\nQuestion:", "\nAnswer:")  # another exchange begins: its question or a second answer


def test_only_the_transcript_adds_its_stop_and_only_to_a_chat():
    own = ChatTemplate(gguf_template_source("{{ messages[0]['content'] }}"))
    transcript = ChatTemplate(gguf_template_source(None))
    chat, params = [{"role": "user", "content": "hi"}], GenerationParams(stop=("END",))
    assert own.stops == ()
    assert with_template_stops(chat, params, own.stops).stop == ("END",)
    assert with_template_stops(chat, params, transcript.stops).stop == ("END", "\nQuestion:", "\nAnswer:")
    assert with_template_stops("raw text", params, transcript.stops).stop == ("END",)
