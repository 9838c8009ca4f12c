"""Slash commands typed in the chat input: parsed here, carried out by the chat screen."""
from __future__ import annotations

from dataclasses import dataclass

from localctx.kvcache.errors import UserError

COMMANDS = {
    "system": "/system TEXT sets the system prompt of this chat; /system shows it; /system none removes it",
    "kv": "/kv POLICY re-plans with a KV policy (e.g. int8, int4+res128, int8+sink4+win2048, auto); "
          "/kv shows the one in effect",
    "clear": "/clear empties this chat and the session's cache",
    "plan": "/plan shows the plan and why (also F2)",
    "help": "/help lists commands and keys (also F1)",
}
KEYS = (
    ("Enter", "send"),
    ("Shift+Enter / Ctrl+J", "new line"),
    ("Escape / Ctrl+C", "stop the answer (keeps what was generated)"),
    ("Ctrl+N", "new chat"),
    ("Ctrl+O", "saved chats"),
    ("F2", "the plan and why"),
    ("Ctrl+Q", "quit"),
)


@dataclass(frozen=True)
class SlashCommand:
    name: str
    arg: str


def parse(text: str) -> SlashCommand | None:
    """None when ``text`` is a message for the model (it does not start with '/');
    a UserError when it names no command."""
    stripped = text.strip()
    if not stripped.startswith("/") or stripped.startswith("//"):
        return None
    name, _, arg = stripped[1:].partition(" ")
    name = name.lower()
    if name not in COMMANDS:
        raise UserError(f"unknown command /{name}; /help lists them (start a message with // to send a '/')")
    return SlashCommand(name, arg.strip())


def message_text(text: str) -> str:
    """What is sent for a message that starts with '//' (an escaped slash)."""
    stripped = text.strip()
    return stripped[1:] if stripped.startswith("//") else stripped


def help_text() -> str:
    lines = ["**Commands**", ""] + [f"- {desc}" for desc in COMMANDS.values()]
    lines += ["", "**Keys**", ""] + [f"- `{key}`: {what}" for key, what in KEYS]
    return "\n".join(lines)
