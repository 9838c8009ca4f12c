"""What a KV format costs one model, as the planner's quality budget reads it: the KL divergence of
the next-token distribution from the full-precision cache's (``localctx eval``,
backends/evaluation/divergence.py), and the top-1 agreement.

A figure is *measured* when this model's calibration holds it (``localctx plan --calibrate-quality``,
kvcache/quality_calibration.py), else a *prior* from the committed table assets/kv_quality_kld.json,
keyed by backend, format, head dim and model size class, each row naming the model and command it
came from (docs/quality.md "KL divergence"). The planner never chooses a format whose figure is over
``--max-kld``; where neither exists, kvcache/quality.py's perplexity verdicts apply as before."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from importlib import resources

from localctx.kvcache.errors import UserError
from localctx.kvcache.model_spec import ModelSpec
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.quality import format_key

# nats per token, mean over the scored positions: keeps 8-bit formats and k8v4 (≤ 0.013 measured) and rejects
# llama.cpp's q4_0 on Qwen2.5 0.5B (0.61) and on SmolLM2-135M (0.065; docs/quality.md "KL divergence")
DEFAULT_MAX_KLD = 0.05
PRIORS_ASSET = "kv_quality_kld.json"
CALIBRATED_BACKENDS = ("llamacpp", "torch", "mlx")  # the backends `plan --calibrate-quality` measures
SIZE_CLASSES = ((300e6, "<300M"), (1.2e9, "300M-1.2B"), (4e9, "1.2B-4B"), (15e9, "4B-15B"))


def size_class(n_params: int) -> str:
    """The model size class a prior is keyed by (parameters as the file states them)."""
    return next((name for top, name in SIZE_CLASSES if n_params < top), ">15B")


def prior_key(backend: str, fmt: str, head_dim: int, n_params: int) -> str:
    return f"{backend}/{fmt}/hd{head_dim}/{size_class(n_params)}"


@dataclass(frozen=True)
class KldFigure:
    format: str  # kvcache/quality.py's format_key: precision, group and residual
    mean_kld: float  # nats per token
    p99_kld: float
    top1: float  # fraction of tokens whose most likely next token is the full-precision cache's
    basis: str  # "measured" (this model's calibration) or "prior" (the committed table)
    source: str  # the calibration file, or the prior's model and command
    tokens: int = 0
    window: int = 0  # a window's figure: the window it was measured with, scored only past it (0: a format's)

    def describe(self) -> str:
        how = (f"{self.basis} with window {self.window:,}, scored at the {self.tokens:,} positions past it"
               if self.window else self.basis)
        return (f"KLD {self.mean_kld:.4f} nats/token (p99 {self.p99_kld:.3f}), top-1 {self.top1:.1%}, "
                f"{how}: {self.source}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class KldTable:
    """One model's figures on one backend: measured ones first, then priors (format → KldFigure)."""
    measured: dict = field(default_factory=dict)
    priors: dict = field(default_factory=dict)
    windows: dict = field(default_factory=dict)  # window_key → this model's measured window (KldFigure)

    def figure(self, policy: KVPolicy) -> KldFigure | None:
        """The figure of ``policy``'s format (its precision; a window's format too), judged by --max-kld."""
        if not policy.quantized:
            return None
        key = format_key(policy)
        return self.measured.get(key) or self.priors.get(key)

    def window_figure(self, policy: KVPolicy) -> KldFigure | None:
        """The measured figure of a window of ``policy``'s shape (precision and sinks; the window length
        the calibration could measure is in the figure), quoted beside a windowed plan, not judged."""
        return self.windows.get(window_key(policy)) if policy.evicts and not policy.heavy else None


def window_key(policy: KVPolicy) -> str:
    """What a measured window is stored under: its policy without the window length, e.g. 'fp16+sink4'."""
    return str(replace(policy, window=None, heavy=0))


NO_FIGURES = KldTable()


def parse_priors(data: dict, source: str) -> dict[str, KldFigure]:
    """prior_key → KldFigure from the committed table's ``priors`` rows."""
    try:
        out = {}
        for key, row in data["priors"].items():
            backend, fmt, hd, size = key.split("/")
            if fmt != format_key(KVPolicy.parse(fmt)) or not hd.startswith("hd"):
                raise ValueError(f"key {key!r} must be backend/format/hdN/size-class")
            out[key] = KldFigure(fmt, float(row["mean_kld"]), float(row["p99_kld"]), float(row["top1"]), "prior",
                                 f"{row['model']}, {row['command']}", int(row.get("tokens", 0)))
        return out
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UserError(f"{source} is not a KL divergence table ({type(exc).__name__}: {exc}); restore it from "
                        "the repository") from None


def load_priors() -> dict[str, KldFigure]:
    text = resources.files("localctx.assets").joinpath(PRIORS_ASSET).read_text()
    return parse_priors(json.loads(text), f"assets/{PRIORS_ASSET}")


def priors_for(backend: str, spec: ModelSpec, table: dict[str, KldFigure] | None = None) -> dict[str, KldFigure]:
    """format → prior for this backend, head dim and size class (exact key only: a prior from another
    head dim or size class is no evidence for this model)."""
    table = load_priors() if table is None else table
    out = {}
    for key, fig in table.items():
        if key == prior_key(backend, fig.format, spec.head_dim, spec.n_params):
            out[fig.format] = fig
    return out


def short_words(quality: dict | None) -> str:
    """A plan's figure in a few words (the chat's KV panel): 'KLD 0.0021 nats, top-1 98.7% (measured)'."""
    if not quality:
        return "quality not measured for this model (localctx plan --calibrate-quality)"
    return f"KLD {quality['mean_kld']:.4f} nats, top-1 {quality['top1']:.1%} ({quality['basis']})"
