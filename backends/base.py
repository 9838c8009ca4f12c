"""The backend contract every surface talks to (docs/architecture.md "Flow").

    session = backend.load(model_ref, plan)
    for event in session.generate(messages_or_prompt, params, cancel): ...

A prompt is either a list of chat messages (``{"role", "content"}``, rendered with the model's
own chat template) or a plain string (raw completion, no template)."""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, replace
from typing import Iterator, Sequence, Union

from localctx.kvcache.errors import UserError
from localctx.kvcache.hardware_profile import HardwareProfile
from localctx.kvcache.eviction import policy_cache_layout
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.model_spec import ModelSpec

Message = dict  # {"role": "system" | "user" | "assistant" | "tool", "content": str, ...}


class Chat(list):
    """Chat messages with the functions the model may call (OpenAI's ``tools``: ``{"type": "function",
    "function": {"name", "description", "parameters"}}``), which the chat template renders
    (backends/models/chat_template.py); a plain list of messages is a chat without tools."""

    def __init__(self, messages: Sequence[Message] = (), tools: Sequence[dict] = ()):
        super().__init__(messages)
        self.tools = tuple(tools)


Prompt = Union[str, Sequence[Message]]


@dataclass(frozen=True)
class JsonShape:
    """One form an answer may take: ``prefix``, then one JSON value valid against ``schema`` (a JSON
    Schema, as JSON text), then ``suffix``."""
    schema: str
    prefix: str = ""
    suffix: str = ""


@dataclass(frozen=True)
class OutputConstraint:
    """The answer is exactly one of ``shapes`` and then ends: structured output (``response_format``,
    ``localctx run --json-schema``) and forced tool calls, sampled under a grammar (llama.cpp's own
    engine on llama.cpp, llguidance on torch and MLX). ``field``: where it came from, for errors."""
    shapes: tuple[JsonShape, ...]
    field: str = "response_format"

    @classmethod
    def json_schema(cls, schema: str, field: str = "response_format") -> "OutputConstraint":
        return cls((JsonShape(schema),), field)


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 512
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    speculate: str = "off"  # prompt-lookup drafts (backends/generation/speculation.py): "auto", "ngram" or "off"
    ignore_eos: bool = False  # an end-of-text token does not end the answer (benchmarks: every answer runs max_tokens)
    constraint: OutputConstraint | None = None  # the answer's shape (structured output, forced tool calls)


@dataclass(frozen=True)
class GenerationStats:
    backend: str
    policy: str
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the session's cache (not prefilled again)
    loaded_tokens: int = 0  # of those, tokens read from the prompt cache on disk
    shifted_tokens: int = 0  # of those, tokens kept at moved positions (llama.cpp's chunk reuse: lossy)
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    kv_bytes: int = 0
    kv_tokens: int = 0  # tokens held in the cache now
    evicted_tokens: int = 0  # tokens dropped by a lossy policy so far in this session
    speculate: str = "off"  # what ran: "ngram", "off", or "off (reason)" when asked for but not possible
    decode_steps: int = 0  # forwards after prefill (a speculative one may yield several tokens)
    drafted_tokens: int = 0
    accepted_tokens: int = 0  # drafted tokens the model agreed with
    # the mean time of this answer's verify steps (a draft with the pending token) over the mean of its
    # plain one-token steps; 0.0 until both kinds ran
    verify_cost_ratio: float = 0.0
    # the most tokens a verify step may hold (drafts + 1) and still give one-token decoding's logits bit
    # for bit, as the backend measured it (llama.cpp: llamacpp/speculate.exact_rows); 0: not measured
    verify_exact_rows: int = 0
    # 1 when a decode forward's output was the end-of-text token that ended the answer: that forward's
    # time is in decode_s and the forward in decode_steps, but the token is not in generated_tokens
    stop_token: int = 0

    @property
    def decoded_tokens(self) -> int:
        """Tokens the decode forwards produced: the answer's after the first (which prefill gives),
        and the end-of-text token that ended it."""
        return max(0, self.generated_tokens - 1) + self.stop_token

    @property
    def tokens_per_step(self) -> float:
        """Tokens per decode forward (1.0 without speculation)."""
        n = self.decoded_tokens
        return n / self.decode_steps if self.decode_steps > 0 and n > 0 else 0.0

    @property
    def prefill_tok_s(self) -> float:
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill_s if self.prefill_s > 0 and n > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        # the first generated token comes out of prefill; decode rate counts the steps after it
        n = self.decoded_tokens
        return n / self.decode_s if self.decode_s > 0 and n > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["prefill_tok_s"] = round(self.prefill_tok_s, 2)
        d["decode_tok_s"] = round(self.decode_tok_s, 2)
        d["tokens_per_step"] = round(self.tokens_per_step, 3)
        d["verify_cost_ratio"] = round(self.verify_cost_ratio, 3)
        return d


@dataclass(frozen=True)
class GenerationEvent:
    """One streamed step. ``kind`` is "token" (text holds the new text, possibly empty while a
    multi-byte character is incomplete) or "done" (finish_reason says why: stop, length, cancelled)."""
    kind: str
    stats: GenerationStats
    text: str = ""
    token: int | None = None
    finish_reason: str | None = None


@dataclass(frozen=True)
class Capabilities:
    kv_bits: frozenset = frozenset({16})
    split_kv: bool = False  # keys and values at different precisions (k8v4, kf16v4, ...)
    group_sizes: frozenset = frozenset({32, 64})
    residual: bool = False
    sinks_window: bool = False
    heavy: bool = False
    batch: bool = False
    notes: tuple[str, ...] = ()
    # architectures the engine's own model graph implements; None: whatever its runtime loads (llama.cpp)
    native_graphs: frozenset | None = None

    def model_refusal(self, backend: str, spec: ModelSpec) -> str | None:
        """Why this engine cannot run ``spec``'s architecture, or None."""
        if self.native_graphs is None or spec.architecture in self.native_graphs:
            return None
        return (f"the {backend} backend implements {', '.join(sorted(self.native_graphs))}, not "
                f"{spec.architecture!r}; run it with --backend llamacpp and a GGUF file")

    def refusals(self, policy: KVPolicy) -> list[str]:
        """Reasons this backend cannot run ``policy``; empty when it can."""
        out = []
        unsupported = sorted({policy.k_bits, policy.v_bits} - self.kv_bits, reverse=True)
        if unsupported:
            out.append(f"{' and '.join(f'{b}-bit' for b in unsupported)} KV is not supported (supported: "
                       + ", ".join("fp16" if b == 16 else f"int{b}" for b in sorted(self.kv_bits, reverse=True)) + ")")
        elif policy.split and not self.split_kv:
            out.append(f"keys and values at different precisions ({policy.precision}) are not supported; "
                       "use one precision for both (fp16, int8 or int4) or a backend that splits them (torch, llamacpp)")
        elif policy.quantized and policy.group_size not in self.group_sizes:
            out.append(f"group size {policy.group_size} is not supported")
        if policy.residual and not self.residual:
            out.append("a full-precision residual is not supported")
        if policy.evicts and not self.sinks_window:
            out.append("sinks + window eviction is not supported")
        if policy.heavy and not self.heavy:
            out.append("heavy-hitter eviction is not supported")
        return out


class Session(ABC):
    """A loaded model with its KV cache. Keeps the cache across calls: a conversation that
    grows by a turn only prefills the new tokens."""

    spec: ModelSpec
    plan: Plan
    backend_name: str
    prompt_cache = None  # a kvcache.prompt_cache.PromptCache once enable_prompt_cache() succeeded
    load_parts: dict[str, float] = {}  # seconds of the parts of its load a session timed (run --timings); read-only
    # CPU threads a decode step keeps busy on this machine: llama.cpp's and torch's CPU threads, 1 for a
    # GPU driven from one thread, 0 for a remote server; None: every core (the chat's frames then keep
    # out of the decoder's way, app/chat/frames.py)
    decode_threads: int | None = None

    @abstractmethod
    def generate(self, prompt: Prompt, params: GenerationParams = GenerationParams(),
                 cancel: threading.Event | None = None) -> Iterator[GenerationEvent]:
        """Yields "token" events then exactly one "done" event. Checks ``cancel`` between tokens."""

    def generate_batch(self, prompts: Sequence[Prompt], params: GenerationParams = GenerationParams(),
                       cancel: threading.Event | None = None) -> Iterator[tuple[int, GenerationEvent]]:
        """Independent completions of several prompts, as (index, event) pairs; each index ends with
        its own "done". Backends that batch decode them together (the weights read once per step
        for the whole batch) override this; the default runs them one after another."""
        for i, prompt in enumerate(prompts):
            self.reset()
            for event in self.generate(prompt, params, cancel):
                yield i, event

    @abstractmethod
    def count_tokens(self, prompt: Prompt) -> int:
        """Tokens the prompt takes once rendered (chat template included)."""

    def enable_prompt_cache(self, model_path) -> str | None:
        """Keep long prompts' KV on disk (kvcache/prompt_cache.py); returns why not, or None."""
        return f"the {self.backend_name} backend keeps no prompt cache on disk"

    def constraint_refusal(self, constraint: OutputConstraint) -> str | None:
        """Why this session cannot sample under ``constraint`` (its grammar engine does not take the
        schema, or it has none), or None when it can. May compile and cache the grammar."""
        return f"{constraint.field}: the {self.backend_name} backend has no constrained decoding"

    def tool_format(self):
        """How this model's answers call tools (a backends/models/tool_calls.ToolFormat): its chat
        template's format; hermes where the session has no template of its own."""
        from localctx.backends.models.tool_calls import HERMES

        return HERMES

    def enable_cache_reuse(self, min_run: int) -> str | None:
        """Keep cached runs of at least ``min_run`` tokens that reappear later in the next prompt,
        moved to their new positions (lossy; llama.cpp only); returns why not, or None."""
        return f"the {self.backend_name} backend has no shift-based chunk reuse (llama.cpp only)"

    def reset(self) -> None:
        """Forget the cached conversation."""

    def close(self) -> None:
        """Release the weights and the cache."""

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Backend(ABC):
    name: str = ""
    kv_cell_tokens: int = 1  # a KV allocation is a whole number of these (plan.sized_to rounds up to it)
    # True: a session reserves its KV at load, sized to the work (plan.sized_to), and grows it at thresholds;
    # False: its buffers grow as tokens arrive and nothing is reserved at load (MLX), so the plan is not sized
    # and the session records in it what the buffers take as they grow (Plan.grow_to)
    kv_reserved_at_load: bool = True

    def unavailable_reason(self) -> str | None:
        """None when the backend can run here, else why not (and what to install)."""
        return None

    @abstractmethod
    def capabilities(self) -> Capabilities: ...

    def calibration_name(self) -> str:
        """The name its speed calibrations are stored under (kvcache.calibration): the backend's name,
        plus the settings its speed depends on where those vary from run to run."""
        return self.name

    def refusals(self, policy: KVPolicy, spec: ModelSpec | None = None) -> list[str]:
        return self.capabilities().refusals(policy)

    def describe_kv(self, policy: KVPolicy) -> str:
        """What this backend's KV cache holds for ``policy``, in words, starting "exact: " or "lossy: "
        (what ``plan``, ``run --json``, the chat panel and serve's /v1/models show). The default is
        the policy cache's layout (kvcache/eviction.py), which the torch and MLX backends run."""
        return policy_cache_layout(policy)

    def kv_elem_bytes(self, spec: ModelSpec, hw: HardwareProfile) -> int:
        """Bytes of one full-precision KV element as this backend holds it for ``spec`` on ``hw`` (what the
        planner counts: BackendView.elem_bytes); the model file's by default (llama.cpp's f16 cache)."""
        return spec.kv_elem_bytes

    def kv_allocation(self):
        """``(spec, policy, context) -> bytes`` where this backend's KV allocation differs from the cost
        model's peak (cells padded, sliding layers sized its own way); None where it does not."""
        return None

    def check_model(self, spec: ModelSpec) -> None:
        """Refuse, in one line, a model whose architecture this engine cannot run."""
        reason = self.capabilities().model_refusal(self.name, spec)
        if reason:
            raise UserError(reason)

    @abstractmethod
    def load(self, model, plan: Plan) -> Session:
        """``model`` is a resolved ``ModelRef``. Raises UserError for bad models or refused plans."""


@dataclass
class StatsClock:
    """Accumulates timings for a generation and stamps GenerationStats from them."""
    backend: str
    policy: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    loaded_tokens: int = 0
    shifted_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    extra: dict = field(default_factory=dict)
    speculate: str = "off"
    decode_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_cost_ratio: float = 0.0
    verify_exact_rows: int = 0
    stop_token: int = 0

    def stats(self, kv_bytes: int, kv_tokens: int, evicted: int = 0) -> GenerationStats:
        return GenerationStats(backend=self.backend, policy=self.policy, prompt_tokens=self.prompt_tokens,
                               cached_tokens=self.cached_tokens, loaded_tokens=self.loaded_tokens,
                               shifted_tokens=self.shifted_tokens,
                               generated_tokens=self.generated_tokens,
                               prefill_s=self.prefill_s, decode_s=self.decode_s, kv_bytes=kv_bytes,
                               kv_tokens=kv_tokens, evicted_tokens=evicted, speculate=self.speculate,
                               decode_steps=self.decode_steps, drafted_tokens=self.drafted_tokens,
                               accepted_tokens=self.accepted_tokens, verify_cost_ratio=self.verify_cost_ratio,
                               verify_exact_rows=self.verify_exact_rows, stop_token=self.stop_token)


def with_template_stops(prompt: Prompt, params: GenerationParams, stops: tuple[str, ...]) -> GenerationParams:
    """A chat rendered in a format whose answers end at a marker (the base-model transcript's next
    question) stops there too; a raw prompt keeps only the caller's stops."""
    if isinstance(prompt, str) or not stops:
        return params
    return replace(params, stop=params.stop + tuple(stops))


def check_prompt_fits(n_prompt: int, plan: Plan, spec: ModelSpec, max_tokens: int) -> None:
    """Refuse, never truncate: a prompt that cannot fit the session's context is a UserError."""
    if n_prompt == 0:
        raise UserError("the prompt is empty: give a prompt as an argument or on stdin")
    if plan.policy.evicts:
        return  # a windowed cache streams past its budget by design
    if n_prompt >= plan.context:
        windowed = windowed_policy_for(plan, spec)
        raise UserError(
            f"the prompt is {n_prompt:,} tokens but the context holds {plan.context:,} "
            f"({spec.name} was trained on {spec.context_length:,}); shorten the prompt, split it "
            "(localctx summarize handles long documents)"
            + (f", or use a windowed policy such as --kv {windowed}" if windowed else ""))


def windowed_policy_for(plan: Plan, spec: ModelSpec) -> KVPolicy | None:
    """A sinks + window policy the plan's backend accepts for ``spec`` (8-bit KV where it can,
    else full precision; llama.cpp shifts fp16 KV only), window half the context; None if none."""
    from localctx.backends import registry

    window = max(1, min(plan.context, spec.context_length) // 2)
    cls = registry.backend_class(plan.backend) if plan.backend in registry.names() else None
    for bits in (8, 16):
        policy = KVPolicy(k_bits=bits, v_bits=bits, sinks=4, window=window)
        if cls is None or not cls().refusals(policy, spec):
            return policy
    return None
