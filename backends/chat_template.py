"""Chat templates from model files, rendered in a sandboxed Jinja environment."""
from __future__ import annotations

from datetime import datetime
from typing import Sequence

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from localctx.kvcache.errors import UserError

# used when a model ships no template: ChatML, which most instruct models of this family know
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Gemma's turn format, for a Gemma GGUF that ships no template: no system role (a system message
# opens the first user turn, as Gemma's own template does), the assistant is "model"
GEMMA = ("{{ bos_token }}{% set ns = namespace(prefix='') %}{% for message in messages %}"
         "{% if message['role'] == 'system' %}{% set ns.prefix = message['content'] + '\n\n' %}{% else %}"
         "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' + ns.prefix"
         " + message['content'] | trim }}{{ '<end_of_turn>\n' }}{% set ns.prefix = '' %}{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
# texts of the tokens that end a turn (llama.cpp counts these as end-of-generation too)
END_OF_TURN = {"<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>"}


def fallback_template(architecture: str | None) -> str:
    """The template for a model file that ships none, by its architecture."""
    return GEMMA if str(architecture).startswith("gemma") else CHATML


def _raise(message: str):
    raise TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source or CHATML
        try:
            self._template = env.from_string(self.source)
        except TemplateError as exc:
            raise UserError(f"the model's chat template does not parse ({exc}); pass a plain prompt "
                            "or fix the template") from None
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise UserError("each chat message needs a 'role' and a 'content'")
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError as exc:
            raise UserError(f"the model's chat template refused these messages: {exc}") from None
