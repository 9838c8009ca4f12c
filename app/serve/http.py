"""The HTTP side on Starlette: routes, body limits, SSE, and the bridge to the scheduler thread
(each request gets an asyncio queue the scheduler feeds thread-safely). Who may call the routes
(the API key, the host rule, media types, CORS) is app/serve/access.py, in front of all of them.

A request's prompt is tokenized here, on a worker thread, before the scheduler sees it, and its
structured output or forced tool call compiled into a grammar the same way (``_structured``;
app/serve/structured.py). A client
that disconnects sets its job's cancel flag, at any point: while it waits in the queue or for its
first token (``_next`` polls ``is_disconnected``), or mid-stream (Starlette cancels the body
when the client goes, or a send fails). Whatever a route raises is answered in OpenAI's error
shape, never as a bare 500."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from localctx.app.serve import protocol, structured
from localctx.app.serve.access import Access, AccessLayer
from localctx.app.serve.metrics import CONTENT_TYPE, ServeMetrics
from localctx.app.serve.protocol import ApiError, RequestRules
from localctx.app.serve.scheduler import Failed, Refused, Scheduler, ServeJob
from localctx.backends.base import GenerationEvent
from localctx.kvcache.errors import UserError
from localctx.kvcache.plan import Plan
from localctx.kvcache.model_spec import ModelSpec

POLL_S = 0.25
log = logging.getLogger("localctx.serve")


@dataclass
class ServeState:
    scheduler: Scheduler
    model_id: str
    spec: ModelSpec
    plan: Plan
    access: Access = field(default_factory=Access)
    rules: RequestRules = field(default_factory=RequestRules)
    max_body_bytes: int = 4 * 1024 * 1024
    request_timeout_s: float = 600.0


def error_response(err: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after)} if err.retry_after is not None else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _from_refused(r: Refused) -> ApiError:
    return ApiError(r.status, r.message, type=r.type, code=r.code, param=r.param, retry_after=r.retry_after)


async def _read_json(state: ServeState, request: Request):
    limit = state.max_body_bytes
    declared = request.headers.get("content-length")
    too_big = ApiError(413, f"the request body is over the server's limit of {limit:,} bytes; send less text "
                            "(localctx summarize splits long documents)", code="request_too_large")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_big
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise too_big
    return protocol.parse_json(bytes(body))


async def _tokenize(state: ServeState, prompt) -> tuple[list[int] | None, int]:
    try:
        return await run_in_threadpool(state.scheduler.tokenize, prompt)
    except UserError as exc:
        raise ApiError(400, str(exc), param="messages") from None


def _guarded(handler):
    """``handler`` with every failure answered as an OpenAI-shaped error (a bug: 500, logged)."""
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as err:
            return error_response(err)
        except ConnectionResetError:  # the client left before the answer: nobody reads this
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - one request's failure, answered as such
            log.exception("%s failed", request.url.path)
            return error_response(ApiError(500, f"the server failed on this request: {type(exc).__name__}",
                                           type="server_error"))
    return endpoint


def build_app(state: ServeState) -> AccessLayer:
    scheduler = state.scheduler
    metrics = ServeMetrics(scheduler)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", **scheduler.load()})

    async def models(request: Request) -> Response:
        plan = state.plan
        card = {"id": state.model_id, "object": "model", "created": 0, "owned_by": "localctx",
                "localctx": {"trained_context": state.spec.context_length, "context": plan.context,
                             "plan": plan.to_dict(), "slots": scheduler.streams.capacity,
                             "batching": scheduler.streams.batching, "kv_budget": scheduler.streams.budget,
                             "lanes": scheduler.streams.describe(), "max_tokens": state.rules.max_tokens,
                             "ignore_eos": state.rules.ignore_eos,
                             "kv_lanes_per_min": scheduler.limits.kv_lanes_per_min}}
        return JSONResponse({"object": "list", "data": [card]})

    async def prometheus(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def count_tokens(request: Request) -> Response:
        """POST {"messages": [...]} or {"prompt": "..."} → {"count": N, "context": C}: the served
        tokenizer's count, chat template included (the openai backend sizes chunks with it)."""
        body = await _read_json(state, request)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        _, n = await _tokenize(state, protocol.count_prompt(body))  # a chat's tools as its template renders them
        return JSONResponse({"count": n, "context": state.plan.context})

    def completion_route(chat: bool):
        async def endpoint(request: Request) -> Response:
            body = await _read_json(state, request)
            parsed = protocol.parse(body, chat, state.model_id, state.plan, state.spec.context_length, state.rules)
            return await _serve(state, request, await _structured(state, parsed), metrics)
        return endpoint

    routes = [Route("/health", _guarded(health)), Route("/v1/models", _guarded(models)),
              Route("/metrics", _guarded(prometheus)),
              Route("/v1/chat/completions", _guarded(completion_route(True)), methods=["POST"]),
              Route("/v1/completions", _guarded(completion_route(False)), methods=["POST"]),
              Route("/localctx/count_tokens", _guarded(count_tokens), methods=["POST"])]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        scheduler.close()

    app = Starlette(routes=routes, lifespan=lifespan)
    return AccessLayer(app, state.access, metrics.on_status)


async def _structured(state: ServeState, parsed: protocol.ParsedRequest) -> protocol.ParsedRequest:
    """The request's structured output and forced tool calls as grammars the served engine takes
    (app/serve/structured.prepare, off the event loop: it compiles them), or 400 naming the field."""
    if parsed.tools is None and parsed.params.constraint is None:
        return parsed
    try:
        params, tools = await run_in_threadpool(structured.prepare, parsed.params, parsed.tools,
                                                state.scheduler.session)
    except structured.FieldError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    return dataclasses.replace(parsed, params=params, tools=tools)


async def _serve(state: ServeState, request: Request, parsed: protocol.ParsedRequest,
                 metrics: ServeMetrics) -> Response:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()
    tokens, n_prompt = await _tokenize(state, parsed.prompt)

    def emit(item) -> None:
        metrics.observe(job, item)
        try:
            loop.call_soon_threadsafe(inbox.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass

    job = ServeJob(prompt=parsed.prompt, params=parsed.params, emit=emit, context=parsed.context,
                   policy=parsed.policy, timeout_s=state.request_timeout_s, ids=tokens, n_prompt=n_prompt)
    if await request.is_disconnected():  # gone while its prompt was tokenized
        raise ConnectionResetError("the client disconnected")
    if not state.scheduler.submit(job):
        raise ApiError(503, f"the server is busy ({state.scheduler.limits.max_queue} requests waiting); retry "
                            "after the Retry-After seconds", type="server_error", code="queue_full",
                       retry_after=state.scheduler.limits.retry_after_s)
    watch = _Watch(request, job)
    try:
        first = await watch.next(inbox)
        if isinstance(first, Refused):
            raise _from_refused(first)
        if isinstance(first, Failed):
            raise ApiError(500, first.message, type="server_error")
        ids = protocol.Ids(parsed.chat, state.model_id)
        if parsed.stream:  # from here the stream's own ``finally`` cancels the job when it ends
            return StreamingResponse(_sse(state, ids, parsed, job, inbox, first), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        pieces, event = [first.text], first
        while event.kind != "done":
            item = await watch.next(inbox)
            if isinstance(item, Failed):
                raise ApiError(500, item.message, type="server_error")
            if isinstance(item, Refused):
                raise _from_refused(item)
            event = item
            pieces.append(event.text)
    except BaseException:
        job.cancel.set()  # refused, failed, or the client left: nothing more is generated for it
        raise
    response = protocol.whole(ids, "".join(pieces), event, _plan_of(state, job), parsed, job.timed_out)
    if parsed.tools is not None:
        response = structured.with_calls(response, "".join(pieces), parsed.tools)
    return JSONResponse(response)


def _plan_of(state: ServeState, job: ServeJob) -> Plan:
    """The plan of the lane the job ran in (its KV policy and context), else the served one."""
    return job.lane.plan if job.lane is not None else state.plan


class _Watch:
    """The scheduler's items for one job, with a look at the connection at least every POLL_S: a
    client that leaves cancels its job whether tokens are flowing or not."""

    def __init__(self, request: Request, job: ServeJob):
        self.request, self.job = request, job
        self.checked = time.monotonic()

    async def next(self, inbox: asyncio.Queue):
        while True:
            if time.monotonic() - self.checked >= POLL_S:
                self.checked = time.monotonic()
                if await self.request.is_disconnected():
                    self.job.cancel.set()
                    raise ConnectionResetError("the client disconnected")
            try:
                return await asyncio.wait_for(inbox.get(), POLL_S)
            except asyncio.TimeoutError:
                continue


def _sse_line(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def _sse(state: ServeState, ids: protocol.Ids, parsed: protocol.ParsedRequest, job: ServeJob,
               inbox: asyncio.Queue, first: GenerationEvent) -> AsyncIterator[str]:
    calls = structured.StreamedCalls(parsed.tools) if parsed.tools is not None else None
    try:
        if parsed.chat:
            yield _sse_line(protocol.chunk(ids, None, first=True))
        event = first
        while True:
            if event.kind == "done":
                break
            if event.text and calls is not None:
                for delta in calls.deltas(event.text):
                    yield _sse_line(structured.delta_chunk(ids, delta))
            elif event.text:
                yield _sse_line(protocol.chunk(ids, event.text))
            item = await inbox.get()
            if isinstance(item, (Failed, Refused)):
                err = ApiError(500, item.message, type="server_error")
                yield _sse_line(err.body())
                return
            event = item
        reason, tail = protocol.finish_reason(event, job.timed_out), event.text or None
        if calls is not None:  # the answer's last text, then whatever call it ended
            for delta in calls.deltas(event.text or "", final=True):
                yield _sse_line(structured.delta_chunk(ids, delta))
            reason, tail = structured.finish_with_calls(reason, calls.called), None
        final = protocol.chunk(ids, tail, reason=reason)
        final["localctx"] = protocol.extension(event, _plan_of(state, job), parsed, job.timed_out)
        yield _sse_line(final)
        if parsed.include_usage:
            yield _sse_line({**protocol.chunk(ids, None), "choices": [], "usage": protocol.usage(event)})
        yield _sse_line("[DONE]")
    finally:
        job.cancel.set()  # a no-op after "done"; a client gone mid-stream stops its generation here
        state.scheduler.wake()
