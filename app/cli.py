"""``localctx`` entry point: builds the subcommands and turns errors into one line + an exit code."""
from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

from localctx.kvcache.errors import RuntimeFailure, UserError

# adding a subcommand = a module in localctx.app.commands with register(subparsers) + its name here
COMMANDS = ("run", "chat", "summarize", "plan", "bench", "eval", "models", "pull", "serve", "cache")


def package_version() -> str:
    """The version of this source tree's pyproject.toml when localctx runs from a checkout (an editable
    install's metadata keeps the version it was installed with), else the installed package's."""
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    if pyproject.is_file():
        project = re.search(r"(?ms)^\[project\]$(.*?)(?=^\[)", pyproject.read_text(encoding="utf-8") + "\n[")
        name = re.search(r'(?m)^name\s*=\s*"([^"]+)"', project.group(1)) if project else None
        version = re.search(r'(?m)^version\s*=\s*"([^"]+)"', project.group(1)) if project else None
        if name and name.group(1) == "localctx" and version:
            return version.group(1)
    from importlib.metadata import PackageNotFoundError, version as installed_version

    try:
        return installed_version("localctx")
    except PackageNotFoundError:
        return "unknown (neither installed nor run from a checkout)"


class VersionAction(argparse.Action):
    """--version: looked up only when asked, so that other commands do not pay for it."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"localctx {package_version()}")
        parser.exit()


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for ``argv``: when it names a command, only that command's module is imported (so
    `localctx run` does not pay for Rich, Textual or the bench); otherwise every command, for help."""
    parser = argparse.ArgumentParser(prog="localctx", description="Run LLMs locally with long contexts.")
    parser.add_argument("--version", action=VersionAction, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    named = argv[0] if argv and argv[0] in COMMANDS else None
    for name in (named,) if named else COMMANDS:
        importlib.import_module(f"localctx.app.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except UserError as exc:
        print(f"localctx: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except RuntimeFailure as exc:
        print(f"localctx: failed: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("\nlocalctx: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `localctx run ... | head` closed the pipe: not an error
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
