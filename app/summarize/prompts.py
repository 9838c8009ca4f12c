"""The summarisation prompts, read from assets/prompts/summarize_*.txt. Each file starts with a
``version: N`` line; the manifest records the versions plus a hash of the texts, so editing a
prompt invalidates the summaries made with the old one."""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources

from localctx.kvcache.errors import RuntimeFailure

STEPS = ("system", "whole", "map", "reduce", "refine")
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


@dataclass(frozen=True)
class PromptSet:
    templates: dict  # step → template text
    version: str  # e.g. "1-3f2a9c01": declared versions + hash of the texts

    def messages(self, step: str, **fields) -> list[dict]:
        """Chat messages for one step; only the template's own {placeholders} are filled, so
        braces inside a document are left alone."""
        def fill(m: re.Match) -> str:
            name = m.group(1)
            return str(fields[name]) if name in fields else m.group(0)

        user = _PLACEHOLDER.sub(fill, self.templates[step])
        return [{"role": "system", "content": self.templates["system"]}, {"role": "user", "content": user}]


def load_prompts() -> PromptSet:
    folder = resources.files("localctx.assets") / "prompts"
    templates, versions, digest = {}, [], hashlib.sha256()
    for step in STEPS:
        try:
            raw = (folder / f"summarize_{step}.txt").read_text(encoding="utf-8")
        except OSError as exc:
            raise RuntimeFailure(f"the summarize prompt {step!r} is missing from localctx's assets ({exc}); "
                                 "reinstall localctx") from None
        head, _, body = raw.partition("\n")
        match = re.fullmatch(r"version:\s*(\S+)", head.strip())
        if not match:
            raise RuntimeFailure(f"assets/prompts/summarize_{step}.txt must start with 'version: N'")
        versions.append(match.group(1))
        templates[step] = body.strip("\n")
        digest.update(raw.encode("utf-8"))
    declared = versions[0] if len(set(versions)) == 1 else ".".join(versions)
    return PromptSet(templates, f"{declared}-{digest.hexdigest()[:8]}")
