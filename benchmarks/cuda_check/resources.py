"""A compiled kernel's resource use, read without a GPU.

``triton.compile`` gives PTX, a cubin and metadata (``shared``: the dynamic shared memory Triton
launches with; ``num_warps``). ``CompiledKernel.n_regs``/``n_spills`` are filled only when a driver
loads the cubin, so the registers and spills come from the NVIDIA tools that ship inside the
Triton wheel instead:

- ``ptxas -v`` on the PTX, with the flags Triton itself passes (its ``make_cubin``): registers,
  spill stores/loads, stack frame, static shared memory;
- ``cuobjdump --dump-resource-usage`` on Triton's own cubin: registers, stack, static shared and
  local memory of the binary that would run (the two register counts must agree).
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

_PTXAS_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?")
_PTXAS_FUNC = re.compile(r"Function properties for (\S+)")
_CUOBJDUMP_FUNC = re.compile(r"Function (\S+?):\s*\n\s*(.*)")


@dataclass(frozen=True)
class PtxasInfo:
    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack_frame: int  # bytes
    static_smem: int  # bytes


@dataclass(frozen=True)
class CubinInfo:
    registers: int
    stack: int
    shared: int  # static shared memory in the cubin (Triton's is dynamic: metadata.shared)
    local: int


def parse_ptxas(log: str, function: str) -> PtxasInfo:
    """``ptxas -v`` output → the resource use of ``function`` (one kernel per PTX from Triton)."""
    lines = log.splitlines()
    for i, line in enumerate(lines):
        found = _PTXAS_FUNC.search(line)
        if not found or found.group(1) != function:
            continue
        props = _PTXAS_PROPS.search("\n".join(lines[i + 1:i + 3]))
        used = _PTXAS_USED.search("\n".join(lines[i + 1:i + 4]))
        if props is None or used is None:
            break
        return PtxasInfo(registers=int(used.group(1)), spill_stores=int(props.group(2)),
                         spill_loads=int(props.group(3)), stack_frame=int(props.group(1)),
                         static_smem=int(used.group(2) or 0))
    raise ValueError(f"no resource lines for {function!r} in the ptxas log:\n{log[-2000:]}")


def parse_cuobjdump(text: str, function: str) -> CubinInfo:
    """``cuobjdump --dump-resource-usage`` output → the resource use of ``function``."""
    for name, fields in _CUOBJDUMP_FUNC.findall(text):
        if name != function:
            continue
        values = dict(re.findall(r"([A-Z]+(?:\[\d+\])?):(\d+)", fields))
        return CubinInfo(registers=int(values["REG"]), stack=int(values["STACK"]), shared=int(values["SHARED"]),
                         local=int(values["LOCAL"]))
    raise ValueError(f"no resource usage for {function!r} in the cuobjdump output:\n{text[-2000:]}")


@dataclass(frozen=True)
class Tools:
    """The wheel's tools; ``ptxas_for`` is the ptxas Triton itself runs for an architecture (its
    ``get_ptxas``: the CUDA 12.x one below sm_90, the 13.x one from sm_90 on)."""
    cuobjdump: str

    @classmethod
    def from_triton(cls) -> "Tools":
        import triton

        path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: this Triton wheel ships no NVIDIA tools")
        return cls(str(path))

    @staticmethod
    def ptxas_for(capability: int) -> str:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(capability).path

    def versions(self, capabilities=(89, 90)) -> dict:
        def version(path: str) -> str:
            text = subprocess.run([path, "--version"], capture_output=True, text=True).stdout.strip()
            return text.splitlines()[-1] if text else "unknown"

        out = {f"ptxas (sm_{c})": version(self.ptxas_for(c)) for c in capabilities}
        out["cuobjdump"] = version(self.cuobjdump)
        return out


def ptxas_info(tools: Tools, ptx: str, arch: str, function: str, fmad: bool = True) -> PtxasInfo:
    """Run ptxas -v on ``ptx`` with Triton's flags (``-lineinfo``, ``--regAllocOptLevel=2``) and
    Triton's ptxas and ``--gpu-name`` for ``arch`` (capability 90 compiles as sm_90a)."""
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    capability = int(arch.removeprefix("sm_"))
    with tempfile.TemporaryDirectory(prefix="cuda-compile-") as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        cmd = [tools.ptxas_for(capability), "-lineinfo", *([] if fmad else ["--fmad=false"]), "-v",
               "--regAllocOptLevel=2", f"--gpu-name={sm_arch_from_capability(capability)}", str(src), "-o",
               str(Path(tmp) / "k.cubin")]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if run.returncode:
        raise RuntimeError(f"ptxas failed ({run.returncode}): {run.stderr[-2000:]}")
    return parse_ptxas(run.stderr + run.stdout, function)


def cubin_info(tools: Tools, cubin: bytes, function: str) -> CubinInfo:
    with tempfile.TemporaryDirectory(prefix="cuda-compile-") as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        run = subprocess.run([tools.cuobjdump, "--dump-resource-usage", str(path)], capture_output=True, text=True,
                             timeout=120)
    if run.returncode:
        raise RuntimeError(f"cuobjdump failed ({run.returncode}): {run.stderr[-2000:]}")
    return parse_cuobjdump(run.stdout, function)


def as_dict(info) -> dict:
    return asdict(info)
