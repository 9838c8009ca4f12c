"""``localctx`` entry point: builds the subcommands and turns errors into one line + an exit code."""
from __future__ import annotations

import argparse
import importlib
import sys

from localctx.kvcache.errors import RuntimeFailure, UserError

# adding a subcommand = a module in localctx.app.commands with register(subparsers) + its name here
COMMANDS = ("run", "chat", "summarize", "plan", "bench", "eval", "models", "pull", "serve", "cache")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for ``argv``: when it names a command, only that command's module is imported (so
    `localctx run` does not pay for Rich, Textual or the bench); otherwise every command, for help."""
    parser = argparse.ArgumentParser(prog="localctx", description="Run LLMs locally with long contexts.")
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
