"""How a benchmark script hands over its result: printed as JSON, and written (atomically) to the
``--json`` path when one is given, for the docs page beside which it is committed."""
from __future__ import annotations

import json
from pathlib import Path

from localctx.app.summarize.store import atomic_write


def emit(result: dict, path: str | None) -> None:
    text = json.dumps(result, indent=1)
    print(text)
    if path:
        atomic_write(Path(path), text + "\n")
