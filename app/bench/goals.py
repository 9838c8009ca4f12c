"""The speed goals of the bench, checked on what this run measured. Each says holds / fails / not
measured, with the numbers behind it."""
from __future__ import annotations

from localctx.app.bench.results import WINDOW_GOAL, decode_at
from localctx.app.bench.settings import context_label
from localctx.kvcache.policy import KVPolicy


def _ratio_text(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def once_full(entry: dict, long_context: int) -> tuple[int, float] | None:
    """(context, decode(long) ÷ decode there) from the first measured context at which the window
    is full: how the cost moves once the cache stops growing. None if no such shorter context."""
    cap = KVPolicy.parse(entry["policy"]).capacity()
    long_tok_s = decode_at(entry, long_context)
    if cap is None or not long_tok_s:
        return None
    full = sorted(p["context"] for p in entry["points"]
                  if p["status"] == "ok" and cap <= p["context"] < long_context)
    if not full or not decode_at(entry, full[0]):
        return None
    return full[0], long_tok_s / decode_at(entry, full[0])


def window_goal(entries: list[dict], head: dict | None) -> dict:
    goal = f"policies with a window hold decode(long)/decode(short) ≥ {WINDOW_GOAL}"
    ratios = {r["series"]: r["ratio"] for r in (head or {}).get("rows", [])}
    windowed = [e for e in entries if not e["baseline"] and KVPolicy.parse(e["policy"]).evicts]
    measured = {e["key"]: ratios.get(e["key"]) for e in windowed if ratios.get(e["key"]) is not None}
    if not measured:
        return {"goal": goal, "status": "not measured",
                "detail": "no windowed policy ran to both headline contexts on a backend of this build"}
    bad = {k: v for k, v in measured.items() if v < WINDOW_GOAL}
    parts = []
    for e in (e for e in windowed if e["key"] in measured):
        text = f"{e['key']} {_ratio_text(measured[e['key']])}"
        full = once_full(e, head["long"])
        if full and full[0] > head["short"]:  # the short context held fewer tokens than the window
            text += (f" (the window fills by {context_label(full[0])}; {context_label(head['long'])} ÷ "
                     f"{context_label(full[0])} = {_ratio_text(full[1])})")
        parts.append(text)
    return {"goal": goal, "status": "fails" if bad else "holds", "detail": ", ".join(parts)}


def quant_vs_fp16(entries: list[dict], context: int) -> list[dict]:
    """Each quantized series against the same backend's fp16 (same window/sinks) at ``context``."""
    rows = []
    by_key = {e["key"]: e for e in entries}
    for e in entries:
        if e["baseline"]:
            continue
        policy = KVPolicy.parse(e["policy"])
        if not policy.quantized:
            continue
        twin = KVPolicy(sinks=policy.sinks, window=policy.window, heavy=policy.heavy)
        ref = by_key.get(f"{e['backend']}/{twin}")
        mine, theirs = decode_at(e, context), decode_at(ref, context) if ref else None
        rows.append({"backend": e["backend"], "policy": e["policy"], "fp16_policy": str(twin), "context": context,
                     "ratio": mine / theirs if mine and theirs else None})
    return rows


def torch_quant_goal(comparisons: list[dict]) -> dict:
    goal = "quantized KV on the torch backend is not slower than its own fp16 at the long context"
    rows = [r for r in comparisons if r["backend"] == "torch" and r["ratio"] is not None]
    if not rows:
        return {"goal": goal, "status": "not measured",
                "detail": "no torch quantized + fp16 pair measured (torch backend absent or refused here)"}
    slower = [r for r in rows if r["ratio"] < 1.0]
    detail = ", ".join(f"{r['policy']} {_ratio_text(r['ratio'])}× fp16" for r in rows)
    return {"goal": goal, "status": "fails" if slower else "holds", "detail": detail}


def _picks_text(picks: list[dict]) -> str:
    by_backend: dict[str, list[str]] = {}
    for p in picks:
        by_backend.setdefault(p["backend"], []).append(f"{context_label(p['context'])} → {p['policy']}"
                                                       + ("" if p["fp16_fits"] else " (fp16 does not fit)"))
    return "; ".join(f"{b} picks " + ", ".join(v) for b, v in by_backend.items())


PICK_TOLERANCE = 0.05  # a forced pick may measure this much below the fastest alternative (run-to-run noise)


def _measured(entries: list[dict], backend: str, context: int) -> dict[str, float]:
    """policy → measured decode tok/s of this backend's series at ``context``."""
    out = {}
    for e in entries:
        if not e["baseline"] and e["backend"] == backend and (tok_s := decode_at(e, context)):
            out[e["policy"]] = tok_s
    return out


def forced_pick_verdict(pick: dict, entries: list[dict]) -> tuple[str, str]:
    """("good" | "bad" | "unmeasured", text) for one pick made where fp16 was ruled out. Under a memory cap
    the pick must measure within PICK_TOLERANCE of the fastest benched format that fits the cap, is at
    least as precise (the planner trades speed for fidelity, not the reverse) and, like the pick, keeps
    every token (or, like it, evicts). Under a speed target (above the planner's fp16 projection) it must
    measure faster than fp16. A refusal ("none ...") picks nothing slower, so it is good."""
    where = f"{pick['backend']} {context_label(pick['context'])} {pick['forced']}"
    if pick["policy"].startswith("none"):
        return "good", f"{where} → refused"
    measured = _measured(entries, pick["backend"], pick["context"])
    mine = measured.get(pick["policy"])
    if mine is None:
        return "unmeasured", f"{where} → {pick['policy']} (not benched)"
    if pick["forced"] == "memory":
        chosen = KVPolicy.parse(pick["policy"])
        rivals = {p: measured[p] for p in pick["fitting"] if p in measured
                  and KVPolicy.parse(p).evicts == chosen.evicts and KVPolicy.parse(p).k_bits >= chosen.k_bits
                  and KVPolicy.parse(p).v_bits >= chosen.v_bits}
        best = max(rivals, key=rivals.get, default=pick["policy"])
        text = f"{where} → {pick['policy']} {mine:.1f} tok/s"
        if measured.get(best, mine) * (1 - PICK_TOLERANCE) > mine:
            return "bad", text + f", but {best} fits and measured {measured[best]:.1f}"
        return "good", text
    fp16 = measured.get("fp16")
    if fp16 is None:
        return "unmeasured", f"{where} → {pick['policy']} (fp16 not benched)"
    text = f"{where} → {pick['policy']} {_ratio_text(mine / fp16)}× fp16"
    return ("bad" if mine < fp16 else "good"), text


def _verdict(goal: str, judged: list[tuple[str, str]], bad: list[str], unmeasured: list[str], head: str) -> dict:
    status = "fails" if bad else ("not measured" if unmeasured or not judged else "holds")
    detail = head
    if bad:
        detail += "; slower than an alternative: " + ", ".join(bad)
    if unmeasured:
        detail += "; not benched: " + ", ".join(sorted({u.replace(" (not benched)", "") for u in unmeasured}))
    return {"goal": goal, "status": status, "detail": detail}


def planner_goal(planner_picks: list[dict] | None, comparisons: list[dict],
                 forced_picks: list[dict] | None = None, entries: list[dict] | None = None) -> dict:
    """Free picks (never a quantized format slower than fp16 when fp16 fits) and picks under a memory cap
    that rules fp16 out (the fastest benched format that fits, among those as precise as the pick)."""
    goal = ("the planner never picks a quantized KV format the bench shows slower than fp16 when fp16 fits, and "
            "under a memory cap that fp16 does not fit under picks the fastest benched format that fits among those "
            f"at least as precise (within {PICK_TOLERANCE:.0%})")
    if not planner_picks and not forced_picks:
        return {"goal": goal, "status": "not measured", "detail": "the planner was not asked (no planner picks)"}
    ratios = {(r["backend"], r["policy"]): r["ratio"] for r in comparisons if r["ratio"] is not None}
    questioned = [p for p in planner_picks or [] if p["fp16_fits"] and KVPolicy.parse(p["policy"]).quantized
                  if not p["policy"].startswith("none")]
    bad = [f"{p['backend']} {context_label(p['context'])} → {p['policy']}" for p in questioned
           if ratios.get((p["backend"], p["policy"]), 1.0) < 1.0]
    unmeasured = [f"{p['backend']}/{p['policy']}" for p in questioned if (p["backend"], p["policy"]) not in ratios]
    capped = [forced_pick_verdict(p, entries or []) for p in forced_picks or [] if p["forced"] == "memory"]
    bad += [text for verdict, text in capped if verdict == "bad"]
    unmeasured += [text for verdict, text in capped if verdict == "unmeasured"]
    head = _picks_text(planner_picks or [])
    head += ("; under a memory cap: " + ", ".join(text for _v, text in capped) if capped
             else "; no memory-capped picks in this result")
    return _verdict(goal, capped, bad, unmeasured, head)


def planner_speed_goal(forced_picks: list[dict] | None, entries: list[dict]) -> dict:
    goal = "under a speed target above its own fp16 projection, the planner's pick measures faster than fp16"
    judged = [forced_pick_verdict(p, entries) for p in forced_picks or [] if p["forced"] == "speed"]
    if not judged:
        return {"goal": goal, "status": "not measured", "detail": "no speed-target picks in this result"}
    return _verdict(goal, judged, [t for v, t in judged if v == "bad"], [t for v, t in judged if v == "unmeasured"],
                    "picks: " + ", ".join(text for _v, text in judged))


def evaluate(entries: list[dict], head: dict | None, planner_picks: list[dict] | None,
             forced_picks: list[dict] | None = None) -> tuple[list[dict], list[dict]]:
    comparisons = quant_vs_fp16(entries, head["long"]) if head else []
    goals = [window_goal(entries, head), torch_quant_goal(comparisons),
             planner_goal(planner_picks, comparisons, forced_picks, entries), planner_speed_goal(forced_picks, entries)]
    return goals, comparisons
