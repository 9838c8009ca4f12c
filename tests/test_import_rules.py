"""What each top-level folder may import (docs/architecture.md, "What imports what"): app → backends →
kvcache, the kernels beside kvcache only, and nothing imports upwards. Every import counts, the ones
inside functions too."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAY_IMPORT = {
    "app": {"backends", "kvcache", "assets"},
    "backends": {"kvcache", "kernels_cuda", "kernels_metal", "assets"},
    "kernels_cuda": {"kvcache"},  # the pure references each kernel replaces
    "kernels_metal": {"kvcache"},
    "kvcache": {"assets"},
}
# (file, imported module): why it is allowed for now
EXCEPTIONS: dict[tuple[str, str], str] = {}


def imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
    return [name for name in out if name.startswith("localctx.")]


def test_no_folder_imports_one_it_may_not():
    wrong, seen = [], 0
    for folder, allowed in MAY_IMPORT.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            for module in imports(path):
                seen += 1
                target = module.split(".")[1]
                rel = path.relative_to(ROOT).as_posix()
                if target != folder and target not in allowed and (rel, module) not in EXCEPTIONS:
                    wrong.append(f"{rel} imports {module}")
    assert seen > 500  # the walk found the imports
    assert not wrong, "imports against docs/architecture.md's rules:\n" + "\n".join(wrong)


def test_every_exception_is_still_needed():
    """An exception whose import is gone is removed here (and from docs/architecture.md)."""
    for (rel, module), why in EXCEPTIONS.items():
        path = ROOT / rel
        assert path.is_file() and module in imports(path), f"{rel} no longer imports {module}: drop the exception"
