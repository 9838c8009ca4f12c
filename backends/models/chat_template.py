"""Chat templates from model files, rendered in a sandboxed Jinja environment. A ``Chat`` with tools
is rendered through the template's own ``tools`` where it has them, else as tool_calls.plain_messages
(backends/models/tool_calls.py)."""
from __future__ import annotations

import json
from datetime import datetime
from typing import Sequence

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from localctx.backends.base import Chat
from localctx.backends.models import tool_calls
from localctx.kvcache.errors import UserError

# used when a model ships no template: ChatML, which most instruct models of this family know
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# texts of the tokens that end a turn (llama.cpp counts these as end-of-generation too)
END_OF_TURN = {"<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>"}


# a GGUF converted without a chat template is taken as a base (completion) model: the conversation
# becomes a plain question-and-answer transcript it can continue, cut where it starts another exchange
TRANSCRIPT = ("{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
              "{% elif message['role'] == 'user' %}{{ 'Question: ' + message['content'] + '\n' }}"
              "{% else %}{{ 'Answer: ' + message['content'] + '\n' }}{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}{{ 'Answer:' }}{% endif %}")
# its next question, or a second answer: the model has started another exchange of its own
TRANSCRIPT_STOPS = ("\nQuestion:", "\nAnswer:")


def gguf_template_source(source: str | None) -> str:
    """The template a GGUF's chat is rendered with, on every backend: its own, else the transcript."""
    return source or TRANSCRIPT


def _raise(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    """JSON as the templates expect it (plain ``json.dumps``, as transformers renders them; Jinja's own
    filter escapes <, > and & for HTML)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        self.source = source or CHATML
        # how answers call tools, and whether the template renders ``tools`` itself
        self.tool_format, self.renders_tools = tool_calls.detect(self.source)
        try:
            self._template = env.from_string(self.source)
        except TemplateError as exc:
            raise UserError(f"the model's chat template does not parse ({exc}); pass a plain prompt "
                            "or fix the template") from None
        self.bos_token = bos_token
        self.eos_token = eos_token
        # text that ends an answer in this format (the transcript's next question)
        self.stops = TRANSCRIPT_STOPS if self.source == TRANSCRIPT else ()

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise UserError("each chat message needs a 'role' and a 'content'")
        tools = list(messages.tools) if isinstance(messages, Chat) else []
        if self.renders_tools:
            messages = tool_calls.native_messages(messages)
        elif tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            messages, tools = tool_calls.plain_messages(messages, tools), []
        try:
            return self._render(list(messages), add_generation_prompt, tools)
        except TemplateError as exc:
            folded = fold_system(messages)
            if folded is None:
                raise UserError(f"the model's chat template refused these messages: {exc}") from None
        try:  # a template without a system role (Gemma's) takes the system prompt in the first user turn
            return self._render(folded, add_generation_prompt, tools)
        except TemplateError as exc:
            raise UserError(f"the model's chat template refused these messages: {exc}") from None

    def _render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict]) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token, eos_token=self.eos_token, tools=tools or None)


def fold_system(messages: Sequence[dict]) -> list[dict] | None:
    """The messages with the system prompt moved to the head of the first user turn (a blank line
    between), as Gemma's own template does with it; None when there is no system message to move."""
    if not messages or messages[0]["role"] != "system":
        return None
    system, rest = messages[0]["content"], list(messages[1:])
    if rest and rest[0]["role"] == "user":
        return [{**rest[0], "content": f"{system}\n\n{rest[0]['content']}"}] + rest[1:]
    return [{"role": "user", "content": system}] + rest
