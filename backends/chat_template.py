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
