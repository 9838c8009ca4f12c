"""Templates without a system role (Gemma's) take the system prompt in the first user turn, as the
model's own template does; a GGUF without a template gets its architecture's format."""
import pytest

from localctx.backends.chat_template import GEMMA_TURNS, ChatTemplate, builtin_template, fold_system
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


def test_gemma_gguf_without_a_template_gets_gemma_turns():
    assert builtin_template("gemma3") == GEMMA_TURNS and builtin_template("llama") is None
    t = ChatTemplate(GEMMA_TURNS, bos_token="<bos>")
    text = t.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"},
                     {"role": "assistant", "content": "Light."}, {"role": "user", "content": "More"}])
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nWhy?<end_of_turn>\n<start_of_turn>model\nLight."
                    "<end_of_turn>\n<start_of_turn>user\nMore<end_of_turn>\n<start_of_turn>model\n")
