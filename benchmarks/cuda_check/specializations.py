"""Every kernel specialization the CUDA backend can launch, found by launching: each case calls the
real wrapper (``paged_attention.paged_attention``, ``quant_attention.attend``,
``quant_append.quantize_append``) on small CPU tensors while the Triton kernels are swapped for a
recorder, and each recorded launch is turned into what Triton's JIT would compile for it (the
signature, the constexprs and the divisibility attributes, with Triton's own specialization
function). Cases that give the same specialization are one compilation.

The axes: head dims ``dispatch.KERNEL_HEAD_DIMS``; activations fp16 and bf16 (the torch backend
refuses fp32 on CUDA; fp32 runs the kernels only under the interpreter); grouped-query
ratios 1, 4, 7 and 8 (the rows of a program are not specialized, so they share a kernel); the
paged cache with and without keys stored before RoPE; the policy cache with 4- and 8-bit groups
of ``kvcache.policy.GROUP_SIZES`` and with no group yet, with and without the attention mass;
every key tile ``launch.block_n_choices`` allows; quantise-and-append per bits, group and dtype. The
split count is a runtime argument, so it makes no variant."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from localctx.kernels_cuda import attention_kernels, dispatch, launch, quant_append
from localctx.kernels_cuda import paged_attention as paged
from localctx.kernels_cuda import quant_attention
from localctx.kvcache import quant
from localctx.kvcache.policy import GROUP_SIZES
from localctx.kvcache.quant_attention import FullTokens, QuantGroups

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}  # what the torch backend runs on CUDA (ALLOWED)
GQA = (1, 4, 7, 8)
BITS = (4, 8)
KV_HEADS = 2
KERNELS = ((attention_kernels, ("partial_kernel", "merge_kernel", "mass_kernel")),
           (quant_append, ("quant_keys_kernel", "quant_values_kernel")))


@dataclass(frozen=True)
class Case:
    """One call of a wrapper, as the backend makes it."""
    wrapper: str  # "paged" | "policy" | "append"
    head_dim: int
    dtype: str
    gqa: int = 1
    rope: bool = True
    bits: int | None = None  # policy: quantized groups of this many bits (None: no group yet)
    group: int | None = None
    block_n: int | None = None
    want_mass: bool = False

    @property
    def label(self) -> str:
        parts = [self.wrapper, f"d{self.head_dim}", self.dtype]
        if self.wrapper != "append":
            parts.append(f"gqa{self.gqa}")
        if self.wrapper == "paged":
            parts.append("rope" if self.rope else "norope")
        if self.bits:
            parts.append(f"int{self.bits}-g{self.group}")
        elif self.wrapper == "policy":
            parts.append("fp-only")
        if self.block_n:
            parts.append(f"bn{self.block_n}")
        if self.want_mass:
            parts.append("mass")
        return "-".join(parts)


@dataclass
class Launch:
    kernel: object  # the JITFunction
    args: tuple
    kwargs: dict


@dataclass
class Specialization:
    """What one compilation takes, and every case that launches it."""
    kernel: object
    signature: dict
    constexprs: dict  # {(index,): value}
    attrs: dict  # {(index,): [["tt.divisibility", 16]]}
    options: dict  # launch options (num_warps, num_stages) the wrapper passed
    cases: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.kernel.__name__

    def key(self) -> tuple:
        return (self.name, tuple(self.signature.items()), tuple(sorted(self.constexprs.items())),
                tuple(sorted((k, str(v)) for k, v in self.attrs.items())), tuple(sorted(self.options.items())))

    def constexpr_values(self) -> dict:
        names = self.kernel.arg_names
        return {names[path[0]]: value for path, value in sorted(self.constexprs.items())}

    def pointer_types(self) -> dict:
        return {k: v for k, v in self.signature.items() if v.startswith("*")}

    def divisible(self) -> list[str]:
        names = self.kernel.arg_names
        return sorted(names[path[0]] for path, a in self.attrs.items() if a)


class _Recorder:
    def __init__(self, kernel, launches: list):
        self.kernel = kernel
        self.launches = launches

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.launches.append(Launch(self.kernel, args, kwargs))
        return record


@contextlib.contextmanager
def recording():
    """Swap the Triton kernels for recorders; yields the list of launches."""
    launches: list[Launch] = []
    saved = []
    for module, names in KERNELS:
        for name in names:
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, _Recorder(getattr(module, name), launches))
    try:
        yield launches
    finally:
        for module, name, kernel in saved:
            setattr(module, name, kernel)


class _Rope:
    """Stands in for the model's rotary embedding (the launch only needs inv_freq's shape)."""
    def __init__(self, head_dim: int):
        self.inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)

    def rotate(self, x, positions):
        return x


def call(case: Case) -> None:
    """Make the wrapper's call for ``case`` (inside ``recording()``: no kernel runs)."""
    D, dt = case.head_dim, DTYPES[case.dtype]
    config = launch.LaunchConfig(splits=2, block_n=case.block_n)
    if case.wrapper == "paged":
        bs, n_blocks, T = 16, 6, 1
        k = torch.zeros((n_blocks, bs, KV_HEADS, D), dtype=dt)
        table = torch.arange(n_blocks, dtype=torch.int32).reshape(1, n_blocks)
        q = torch.zeros((1, T, KV_HEADS * case.gqa, D), dtype=dt)
        paged.paged_attention(q, k, k.clone(), table, torch.full((1, T), n_blocks * bs - 1),
                              key_rope=_Rope(D) if case.rope else None, config=config)
    elif case.wrapper == "policy":
        N, G = 40, 3
        full = FullTokens(torch.zeros((KV_HEADS, N, D), dtype=dt), torch.zeros((KV_HEADS, N, D), dtype=dt),
                          torch.arange(N))
        groups = None
        if case.bits:
            g, b = case.group, case.bits
            qt = lambda scale_shape: quant.QuantizedTensor(
                torch.zeros((G, KV_HEADS, g, D * b // 8), dtype=torch.uint8),
                torch.zeros(scale_shape, dtype=quant.SCALE_DTYPE), torch.zeros(scale_shape, dtype=quant.SCALE_DTYPE), b)
            groups = QuantGroups(qt((G, KV_HEADS, 1, D)), qt((G, KV_HEADS, g, D // g)),
                                 torch.arange(G * g).reshape(G, g) + N, g)
        q = torch.zeros((1, KV_HEADS * case.gqa, D), dtype=dt)
        quant_attention.attend(q, torch.tensor([N + G * 64]), full, groups, _Rope(D), want_mass=case.want_mass,
                               config=config)
    else:
        G, g = 3, case.group
        x = torch.zeros((G, KV_HEADS, g, D), dtype=dt)
        pool = quant_append.QuantPool.empty(G, KV_HEADS, D, case.bits, g)
        quant_append.quantize_append(x, x.clone(), case.bits, g, pool, torch.arange(G))


def cases(head_dims=None, dtypes=None, gqa=GQA, block_n=None, group_sizes=GROUP_SIZES, bits=BITS) -> list[Case]:
    """Every case; ``block_n`` replaces the launcher's key tiles (``launch.block_n_choices``)."""
    head_dims = head_dims or dispatch.KERNEL_HEAD_DIMS
    dtypes = dtypes or tuple(DTYPES)
    out = []
    for D in head_dims:
        for dt in dtypes:
            for bn in ((block_n,) if block_n else launch.block_n_choices(D)):
                for r in gqa:
                    out += [Case("paged", D, dt, r, rope, block_n=bn) for rope in (False, True)]
                    for mass in (False, True):
                        out.append(Case("policy", D, dt, r, block_n=bn, want_mass=mass))
                        out += [Case("policy", D, dt, r, bits=b, group=g, block_n=bn, want_mass=mass)
                                for b in bits for g in group_sizes]
            out += [Case("append", D, dt, bits=b, group=g) for b in bits for g in group_sizes]
    return out


def subset_ci() -> list[Case]:
    """A representative few for CI: the policy kernel at head dim 128 with 4-bit 64-token groups and
    the attention mass (partial_kernel there spilled on both architectures before groups were read
    in sub-tiles and ``maxnreg`` was set), at head dim 256 with 8-bit 32-token groups (mass_kernel
    there spilled on both), and quantise-and-append at head dim 256 with eight warps."""
    return [Case("policy", 128, "bf16", 4, bits=4, group=64, block_n=32, want_mass=True),
            Case("policy", 256, "fp16", 4, bits=8, group=32, block_n=32, want_mass=True),
            Case("append", 256, "fp16", bits=8, group=32)]


def specializations(all_cases: list[Case], backend) -> list[Specialization]:
    """Record every case's launches and fold them into distinct specializations."""
    from triton._C.libtriton import native_specialize_impl

    found: dict[tuple, Specialization] = {}
    for case in all_cases:
        with recording() as launches:
            call(case)
        for rec in launches:
            spec = _specialize(rec, backend, native_specialize_impl)
            spec = found.setdefault(spec.key(), spec)
            if case.label not in spec.cases:
                spec.cases.append(case.label)
    return list(found.values())


def _specialize(rec: Launch, backend, native_specialize_impl) -> Specialization:
    kernel = rec.kernel
    names = kernel.arg_names
    values = dict(zip(names, rec.args)) | {k: v for k, v in rec.kwargs.items() if k in names}
    options = {k: v for k, v in rec.kwargs.items() if k not in names}
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        value = values[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[(i,)] = "constexpr", value
            continue
        kind, attr = native_specialize_impl(type(backend), value, False, not p.do_not_specialize,
                                            not p.do_not_specialize_on_alignment)
        if kind == "constexpr":
            signature[p.name], constexprs[(i,)] = "constexpr", attr
        else:
            signature[p.name] = kind
            if isinstance(attr, str) and attr:
                attrs[(i,)] = backend.parse_attr(attr)
    return Specialization(kernel, signature, constexprs, attrs, options)
