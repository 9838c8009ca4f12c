"""Every folder that is a package must be listed in pyproject.toml: an editable install hides a
missing entry, the wheel does not."""
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_subpackage_is_listed_in_pyproject():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = set()
    for package, folder in tool["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]))
    assert found == listed, f"missing from pyproject: {sorted(found - listed)}; stale: {sorted(listed - found)}"


def test_no_generic_top_level_names_are_installed():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert all(name.startswith("localctx.") for name in tool["packages"])
