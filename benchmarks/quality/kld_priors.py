"""The planner's KL divergence priors (assets/kv_quality_kld.json) from committed quality calibrations,
and the table in docs/quality.md ("KL divergence"), both by code from the same JSON.

    python benchmarks/quality/kld_priors.py docs/results/quality/kld-*.json            # writes the asset
    python benchmarks/quality/kld_priors.py --markdown docs/results/quality/kld-*.json # prints the table

Each input is a calibration file as ``localctx plan --calibrate-quality`` writes it (the user cache's
quality/ folder), copied under docs/results/quality/. A prior is keyed backend/format/hdHEADDIM/SIZECLASS
(kvcache/kld_quality.py); two calibrations of the same key keep the larger KL divergence."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from localctx.kvcache.kld_quality import PRIORS_ASSET, size_class

ROOT = Path(__file__).resolve().parents[2]
ABOUT = ("Priors for the planner's quality budget (kvcache/kld_quality.py): mean and 99th-percentile KL divergence "
         "(nats per token) of the next-token distribution from the full-precision cache's, and top-1 agreement, "
         "keyed backend/format/hdHEADDIM/SIZECLASS. Written by python benchmarks/quality/kld_priors.py from the "
         "calibrations under docs/results/quality/ (docs/quality.md, KL divergence); each row names its model, "
         "command and result file.")


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_absolute() else path.as_posix()


def shape(data: dict, path: Path) -> dict:
    """head_dim and size class: from the calibration, or (older files) read from the model file it names,
    or, where that file is gone from this machine, as the committed priors recorded them from this file."""
    if "head_dim" in data:
        return data | {"size_class": size_class(int(data["n_params"]))}
    model = Path(data["model"]["file"])
    if model.exists():
        from localctx.backends.models.ref import resolve
        from localctx.backends.models.spec_reader import read_spec

        spec = read_spec(resolve(str(model)))
        return data | {"head_dim": spec.head_dim, "size_class": size_class(spec.n_params)}
    committed = json.loads((ROOT / "assets" / PRIORS_ASSET).read_text())["priors"]
    for key, row in committed.items():
        if row["result"] == relative(path):
            _, _, hd, size = key.split("/")
            return data | {"head_dim": int(hd[2:]), "size_class": size}
    raise SystemExit(f"{relative(path)} names no head dim or size, its model file {model} is gone and "
                     f"assets/{PRIORS_ASSET} has no row from it; run on a machine with the model file")


def rows(paths: list[Path], windows: bool = False):
    """(path, calibration, format, figures) per format; with ``windows``, the measured windows after
    each file's formats (a window is quoted beside a windowed plan, never a prior: its cost is the
    text's and the window length's)."""
    for path in paths:
        data = shape(json.loads(path.read_text()), path)
        for fmt, f in data["figures"].items():
            yield path, data, fmt, f
        for policy, f in (data.get("windows", {}) if windows else {}).items():
            yield path, data, policy, f


def priors(paths: list[Path]) -> dict:
    out = {}
    for path, data, fmt, f in rows(paths):
        key = f"{data['backend']}/{fmt}/hd{data['head_dim']}/{data['size_class']}"
        row = {"mean_kld": f["mean_kld"], "p99_kld": f["p99_kld"], "top1": f["top1"],
               "ppl_delta_pct": f["ppl_delta_pct"], "tokens": f["tokens"], "model": data["model_name"],
               "command": data["command"].replace(data["model"]["file"], Path(data["model"]["file"]).name),
               "result": relative(path)}
        if key not in out or row["mean_kld"] > out[key]["mean_kld"]:
            out[key] = row
    return dict(sorted(out.items()))


def scored(f: dict) -> str:
    if "score_from" in f:
        return f"{f['tokens']:,} past the window (from {f['score_from']:,})"
    return f"{f['tokens']:,}"


def nats(x: float, places: int) -> str:
    """A KL divergence as the table shows it; under 0.001 nats in powers of ten, not as 0.0000."""
    return f"{x:.{places}f}" if x >= 1e-3 or x == 0 else f"{x:.1e}"


def markdown(paths: list[Path]) -> str:
    lines = ["| model | backend | head dim, size | format | positions scored | KLD mean (nats) | KLD p99 | top-1 "
             "| ppl vs fp16 |", "|---|---|---|---|---|---:|---:|---:|---:|"]
    for _, data, fmt, f in rows(paths, windows=True):
        lines.append(f"| {data['model_name']} | {data['backend']} | {data['head_dim']}, "
                     f"{data['size_class']} | {fmt} | {scored(f)} | {nats(f['mean_kld'], 4)} | "
                     f"{nats(f['p99_kld'], 3)} | {f['top1']:.1%} | {f['ppl_delta_pct']:+.2f}% |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("calibrations", nargs="+", type=Path)
    ap.add_argument("--markdown", action="store_true", help="print the docs table instead of writing the asset")
    args = ap.parse_args()
    paths = [p.resolve() for p in args.calibrations]
    if args.markdown:
        print(markdown(paths))
        return
    target = ROOT / "assets" / PRIORS_ASSET
    target.write_text(json.dumps({"about": ABOUT, "priors": priors(paths)}, indent=2) + "\n")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
