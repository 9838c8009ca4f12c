"""``localctx models``: the models available locally, with size, architecture, trained context, attention
layout (e.g. "5 local : 1 global, window 512") and the backends that can run each."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from localctx.backends import registry
from localctx.backends.models.spec_reader import read_spec
from localctx.backends.models.ref import ModelRef, bundled_default_path, hub_cache_dir, resolve
from localctx.kvcache.cost import format_bytes
from localctx.kvcache.errors import UserError
from localctx.kvcache.model_spec import ModelSpec, describe_layout


def register(sub) -> None:
    p = sub.add_parser("models", help="list local models (bundled, Hugging Face cache, extra paths)")
    p.add_argument("paths", nargs="*", help="extra .gguf files or folders to describe")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=handle)


def local_models(extra: list[str]) -> list[ModelRef]:
    refs: list[ModelRef] = []
    try:
        refs.append(ModelRef("gguf", bundled_default_path(), "SmolLM2-135M-Instruct (default)", "bundled"))
    except UserError:
        pass
    refs.extend(_hub_cache())
    for item in extra:
        path = Path(item)
        files = sorted(path.rglob("*.gguf")) if path.is_dir() and not (path / "config.json").exists() else [path]
        refs.extend(resolve(str(f)) for f in files)
    return refs


def _hub_cache() -> list[ModelRef]:
    try:
        from huggingface_hub import scan_cache_dir
        info = scan_cache_dir(hub_cache_dir())
    except Exception:  # no cache yet, or an unreadable one: nothing cached to list
        return []
    refs = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        for rev in repo.revisions:
            snap = Path(rev.snapshot_path)
            if (snap / "config.json").is_file() and any(snap.glob("*.safetensors")):
                refs.append(ModelRef("hf", snap, repo.repo_id, "hub-cache"))
            refs.extend(ModelRef("gguf", g, f"{repo.repo_id}:{g.stem}", "hub-cache") for g in snap.rglob("*.gguf"))
    return refs


def _size(ref: ModelRef) -> int:
    if ref.path.is_dir():
        return sum(p.stat().st_size for p in ref.path.iterdir() if p.is_file())
    return ref.path.stat().st_size


def runnable_on(ref: ModelRef, spec: ModelSpec) -> list[str]:
    """The backends in this build whose engine runs this model's architecture and file kind."""
    out = []
    for name in registry.USER_FACING:
        cls = registry.backend_class(name)
        if cls is None or (name == "llamacpp" and ref.kind != "gguf"):
            continue
        if cls().capabilities().model_refusal(name, spec) is None:
            out.append(name)
    return out


def describe(ref: ModelRef) -> dict:
    row = {"name": ref.name, "path": str(ref.path), "source": ref.source, "size_bytes": _size(ref)}
    try:
        spec = read_spec(ref)
        row.update(architecture=spec.architecture, context_length=spec.context_length, layers=spec.n_layers,
                   attention=describe_layout(spec), backends=runnable_on(ref, spec),
                   assumptions=list(spec.assumptions))
    except UserError as exc:
        row.update(architecture="?", context_length=None, attention="?", backends=[], error=str(exc))
    return row


def handle(args: argparse.Namespace) -> int:
    rows = [describe(r) for r in local_models(args.paths)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no local models; `localctx pull REPO` fetches one")
        return 0
    print(f"{'NAME':40} {'SIZE':>10} {'ARCH':9} {'CONTEXT':>8}  {'ATTENTION':34} {'BACKENDS':20} SOURCE")
    for r in rows:
        ctx = f"{r['context_length']:,}" if r.get("context_length") else "?"
        backends = ",".join(r["backends"]) or "-"
        print(f"{r['name'][:40]:40} {format_bytes(r['size_bytes']):>10} {r['architecture']:9} {ctx:>8}  "
              f"{r['attention'][:34]:34} {backends:20} {r['source']}")
    return 0
