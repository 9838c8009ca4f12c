"""``localctx pull REPO``: download a model through huggingface-hub into its standard cache."""
from __future__ import annotations

import argparse

from localctx.backends.models.ref import hub_cache_dir, hub_offline
from localctx.kvcache.errors import RuntimeFailure, UserError


def register(sub) -> None:
    p = sub.add_parser("pull", help="download a model from the Hugging Face hub into its cache")
    p.add_argument("repo", help="repo id, e.g. HuggingFaceTB/SmolLM2-360M-Instruct")
    p.add_argument("--include", action="append", default=None, metavar="PATTERN",
                   help="only files matching this glob (repeatable), e.g. '*Q4_K_M.gguf'")
    p.add_argument("--revision", default=None)
    p.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    if "/" not in args.repo:
        raise UserError(f"{args.repo!r} is not a repo id; use OWNER/NAME, e.g. HuggingFaceTB/SmolLM2-135M-Instruct")
    if hub_offline():
        raise RuntimeFailure(f"the Hugging Face hub cannot be reached: HF_HUB_OFFLINE is set; unset it and "
                             f"try again with a connection ({args.repo} was not downloaded)")
    patterns = args.include or ["*.json", "*.safetensors", "*.gguf", "tokenizer*", "*.jinja", "*.txt"]
    try:
        path = snapshot_download(args.repo, revision=args.revision, allow_patterns=patterns,
                                 cache_dir=hub_cache_dir())
    except RepositoryNotFoundError:
        raise UserError(f"repo {args.repo} does not exist on the hub (or needs a token: huggingface-cli login)") from None
    except LocalEntryNotFoundError:
        raise RuntimeFailure(f"the Hugging Face hub cannot be reached (offline or HF_HUB_OFFLINE set); "
                             f"{args.repo} was not downloaded. Try again with a connection") from None
    except (HfHubHTTPError, OSError) as exc:
        raise RuntimeFailure(f"the Hugging Face hub cannot be reached ({type(exc).__name__}); {args.repo} was "
                             "not downloaded. Check the connection and try again") from None
    print(f"pulled {args.repo} into {path}")
    return 0
