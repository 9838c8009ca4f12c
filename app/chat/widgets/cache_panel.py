"""The side panel: live figures from the latest GenerationEvent and the plan."""
from __future__ import annotations

from rich.cells import cell_len
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Label, Static

from localctx.app.chat.figures import CacheFigures
from localctx.kvcache.cost import format_bytes
from localctx.kvcache.kld_quality import CALIBRATED_BACKENDS, short_words

BAR_WIDTH = 24
STATE_LABELS = {"starting": "loading the model…", "idle": "ready", "prefilling": "reading the prompt…", "streaming": "answering…",
                "stopped": "stopped", "done": "done", "failed": "failed", "loading": "re-planning…"}


def bar(used: int, budget: int, width: int = BAR_WIDTH) -> Text:
    """A text bar of ``used`` against ``budget``; over budget fills it and turns red."""
    if budget > 0:
        frac = used / budget
    else:
        frac = float("inf") if used > 0 else 0.0
    filled = width if frac >= 1 else round(frac * width)
    if used > 0 and filled == 0:
        filled = 1
    style = "red" if frac > 1 else ("yellow" if frac > 0.8 else "green")
    return Text.assemble(("█" * filled, style), ("░" * (width - filled), "dim"))


def tok_s(value: float) -> str:
    return f"{value:,.1f} tok/s" if value > 0 else "–"


def unwrapped_lines(shown: str | tuple, width: int) -> int | None:
    """How many lines a Static of ``width`` cells shows for ``shown`` (a _put key), or None when a
    line would wrap (its height then depends on where it wraps)."""
    text = shown if isinstance(shown, str) else shown[0]
    lines = text.split("\n")
    return len(lines) if width > 0 and all(cell_len(line) <= width for line in lines) else None


class CachePanel(VerticalScroll):
    """Shows a CacheFigures; ``figures`` is what it shows now (tests compare it with the events)."""

    def __init__(self, figures: CacheFigures, **kwargs):
        super().__init__(**kwargs)
        self.figures = figures
        self._shown: dict[str, object] = {}  # what each Static shows now: unchanged ones are not updated

    def _put(self, widget_id: str, content: str | Text) -> None:
        """Shows ``content`` in one Static if it changed. A change that keeps the Static's height (as
        many lines, none wider than the panel) only repaints it; a layout would arrange the whole
        screen again, and the figures change with every frame of an answer."""
        key = content if isinstance(content, str) else (content.plain, str(content.style), tuple(content.spans))
        old = self._shown.get(widget_id)
        if old != key:
            self._shown[widget_id] = key
            widget = self.query_one(f"#{widget_id}", Static)
            width = widget.content_region.width
            lines = unwrapped_lines(key, width)
            same_height = lines is not None and old is not None and unwrapped_lines(old, width) == lines
            widget.update(content, layout=not same_height)

    def compose(self) -> ComposeResult:
        yield Label("KV policy", classes="heading")
        yield Static(id="policy")
        yield Static(id="policy-detail", classes="detail")
        yield Label("KV memory", classes="heading")
        yield Static(id="kv-bar")
        yield Static(id="kv")
        yield Static(id="kv-detail", classes="detail")
        yield Label("Context", classes="heading")
        yield Static(id="context-bar")
        yield Static(id="context")
        yield Static(id="context-detail", classes="detail")
        yield Label("Speed", classes="heading")
        yield Static(id="speed")
        yield Label("Session", classes="heading")
        yield Static(id="session")
        yield Static(id="state")

    def on_mount(self) -> None:
        self.show(self.figures)

    def show(self, figures: CacheFigures) -> None:
        self.figures = f = figures
        badge = Text(" EXACT " if f.exact else " LOSSY ", style="bold black on green" if f.exact
                     else "bold black on dark_orange")
        self._put("policy", Text.assemble((f.policy + " ", "bold"), badge))
        detail = f.facts.plan.kv_layout.split(": ", 1)[-1]
        # a lossy plan's KL figure, or where none is known the hint to measure it, on a backend
        # `plan --calibrate-quality` measures (not a remote server's cache, nor the fake backend's)
        plan = f.facts.plan
        judged = not f.exact and (plan.quality or plan.backend in CALIBRATED_BACKENDS)
        self._put("policy-detail", f"{detail}\n{short_words(plan.quality)}" if judged else detail)
        self._put("kv-bar", bar(f.kv_bytes, f.kv_budget))
        self._put("kv", f"{format_bytes(f.kv_bytes)} of {format_bytes(f.kv_budget)} planned" if f.kv_allocated >= f.kv_budget
                  else f"{format_bytes(f.kv_bytes)} of {format_bytes(f.kv_allocated)} allocated, "
                       f"{format_bytes(f.kv_budget)} planned")
        self._put("kv-detail", self._kv_detail(f))
        self._put("context-bar", bar(f.context_used, f.context_budget))
        self._put("context", f"{f.context_used:,} of {f.context_budget:,} tokens")
        self._put("context-detail",
                  f"{f.cached_tokens:,} reused from the cache this turn" if f.stats else "nothing cached yet")
        self._put("speed", f"prefill {tok_s(f.prefill_tok_s)}\ndecode  {tok_s(f.decode_tok_s)}")
        self._put("session",
                  f"backend  {f.facts.backend}\nmodel    {f.facts.model}\nhardware {f.facts.hardware}")
        self._put("state", Text(STATE_LABELS.get(f.state, f.state), style="italic"))

    @staticmethod
    def _kv_detail(f: CacheFigures) -> Text:
        held = f"cache holds {f.kv_tokens:,} tokens"
        if not f.facts.plan.policy.evicts:
            return Text(held)
        if f.evicted_tokens:
            policy = f.facts.plan.policy
            kept = f"kept the first {policy.sinks} and the last {policy.window}" + (
                f" plus {policy.heavy} heavy hitters" if policy.heavy else "")
            return Text.assemble(held + "\n", (f"evicted {f.evicted_tokens:,} tokens; {kept}", "dark_orange"))
        return Text(held + "\nnothing evicted yet")
