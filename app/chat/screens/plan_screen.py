"""The plan view: what the planner chose for this session, what it projects, and why."""
from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Label, Static

from localctx.app.chat.figures import SessionFacts
from localctx.kvcache.cost import format_bytes
from localctx.kvcache.plan import Plan


def projected(value: float | None) -> str:
    return f"{value:,.1f} tok/s" if value is not None else "not projected"


def plan_table(plan: Plan, hardware: str) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    badge = Text(" EXACT " if plan.exact else " LOSSY ", style="bold black on green" if plan.exact
                 else "bold black on dark_orange")
    table.add_row("policy", Text.assemble((str(plan.policy) + " ", "bold"), badge))
    table.add_row("", plan.kv_layout.split(": ", 1)[-1])
    table.add_row("backend", plan.backend)
    table.add_row("hardware", hardware or "not named")
    table.add_row("context", f"{plan.context:,} tokens")
    table.add_row("KV memory", f"{format_bytes(plan.kv_bytes)} at {plan.context:,} tokens (projected peak)")
    table.add_row("weights", format_bytes(plan.weight_bytes))
    table.add_row("total", format_bytes(plan.memory_bytes))
    table.add_row("decode", projected(plan.decode_tok_s))
    table.add_row("prefill", projected(plan.prefill_tok_s))
    return table


def rejected_table(plan: Plan) -> Table | Text:
    if not plan.rejected:
        return Text("No alternative was rejected.", style="dim")
    table = Table(show_edge=False, expand=True, header_style="bold")
    table.add_column("backend", no_wrap=True)
    table.add_column("policy", no_wrap=True)
    table.add_column("why not", ratio=1)
    for r in plan.rejected:
        table.add_row(r.backend, r.policy, r.reason)
    return table


class PlanScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f2,q", "dismiss_plan", "Close")]

    def __init__(self, facts: SessionFacts):
        super().__init__()
        self.facts = facts

    def compose(self) -> ComposeResult:
        plan = self.facts.plan
        with VerticalScroll(id="plan-box"):
            yield Label("The plan", classes="title")
            yield Static(plan_table(plan, self.facts.hardware), id="plan-figures")
            yield Label("Why", classes="heading")
            yield Static("\n".join(f"• {r}" for r in plan.reasons) or "No reasons recorded.", id="plan-reasons")
            yield Label("Rejected", classes="heading")
            yield Static(rejected_table(plan), id="plan-rejected")
            yield Label("Escape closes · /kv POLICY re-plans", classes="hint")

    def action_dismiss_plan(self) -> None:
        self.dismiss(None)
