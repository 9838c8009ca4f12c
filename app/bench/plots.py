"""PNG plots of a bench run (matplotlib, Agg: no display needed): decode tok/s and KV memory
against context, one line per series, the llama.cpp baseline dashed black."""
from __future__ import annotations

from pathlib import Path

from localctx.app.bench.settings import context_label
from localctx.kvcache.errors import UserError

DECODE_PNG = "bench-decode.png"
KV_PNG = "bench-kv.png"
PREFILL_PNG = "bench-prefill.png"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UserError("the table and bench.json are written, but plots need matplotlib: "
                        "pip install 'localctx[bench]' (or pass --no-plots)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _style(entry: dict) -> dict:
    if entry["baseline"]:
        # on top and hollow, so a localctx series that matches it stays visible underneath
        return {"color": "black", "linestyle": "--", "marker": "s", "markerfacecolor": "none", "markersize": 9,
                "zorder": 5}
    return {"marker": "o"}


def _series_points(entry: dict, field: str):
    xs, ys, lo, hi = [], [], [], []
    for p in entry["points"]:
        if p["status"] != "ok":
            continue
        value = p[field]
        xs.append(p["context"])
        if isinstance(value, dict):
            ys.append(value["median"])
            lo.append(value["median"] - value["min"])
            hi.append(value["max"] - value["median"])
        else:
            ys.append(value / 2**20)
    return xs, ys, (lo, hi) if lo else None


def _axes(plt, title: str, ylabel: str, contexts: list[int]):
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=110)
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [context_label(c) for c in contexts])
    ax.minorticks_off()
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _plot(plt, entries: list[dict], field: str, title: str, ylabel: str, contexts: list[int], path: Path) -> Path:
    fig, ax = _axes(plt, title, ylabel, contexts)
    for entry in entries:
        xs, ys, err = _series_points(entry, field)
        if not xs:
            continue
        label = entry["label"]
        if err is not None:
            ax.errorbar(xs, ys, yerr=err, label=label, capsize=3, **_style(entry))
        else:
            ax.plot(xs, ys, label=label, **_style(entry))
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def draw(result: dict, folder: Path) -> list[Path]:
    plt = _pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    entries, contexts = result["series"], result["settings"]["contexts"]
    model = result["model"]["name"]
    return [
        _plot(plt, entries, "decode_tok_s", f"Decode speed vs context — {model} (median, min–max of runs)",
              "decode tok/s", contexts, folder / DECODE_PNG),
        _plot(plt, entries, "kv_bytes", f"KV cache memory vs context — {model}", "KV cache (MiB)", contexts,
              folder / KV_PNG),
        _plot(plt, entries, "prefill_tok_s", f"Prefill speed vs context — {model} (median, min–max of runs)",
              "prefill tok/s", contexts, folder / PREFILL_PNG),
    ]
