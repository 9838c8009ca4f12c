"""The HTTP side on Starlette: routes, the API key, body limits, SSE, and the bridge to the
scheduler thread (each request gets an asyncio queue the scheduler feeds thread-safely).

A client that disconnects sets its job's cancel flag: a streamed response notices when the
send fails (Starlette cancels the body), a whole one by polling ``is_disconnected``."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from dataclasses import dataclass
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from localctx.app.serve import protocol
from localctx.app.serve.protocol import ApiError
from localctx.app.serve.scheduler import Failed, Refused, Scheduler, ServeJob
from localctx.backends.base import GenerationEvent
from localctx.kvcache.plan import Plan
from localctx.kvcache.model_spec import ModelSpec

POLL_S = 0.25


@dataclass
class ServeState:
    scheduler: Scheduler
    model_id: str
    spec: ModelSpec
    plan: Plan
    api_key: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    request_timeout_s: float = 600.0


def error_response(err: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after)} if err.retry_after is not None else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _from_refused(r: Refused) -> ApiError:
    return ApiError(r.status, r.message, type=r.type, code=r.code, param=r.param, retry_after=r.retry_after)


def _check_key(state: ServeState, request: Request) -> None:
    if state.api_key is None:
        return
    auth = request.headers.get("authorization", "")
    given = auth[7:] if auth.lower().startswith("bearer ") else ""
    if not hmac.compare_digest(given.encode(), state.api_key.encode()):
        raise ApiError(401, "Incorrect API key provided: send Authorization: Bearer <the key the server was "
                            "started with>", type="authentication_error", code="invalid_api_key")


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
    try:
        return json.loads(body)
    except ValueError:
        raise ApiError(400, "the request body is not valid JSON") from None


def build_app(state: ServeState) -> Starlette:
    scheduler = state.scheduler

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", **scheduler.load()})

    async def models(request: Request) -> Response:
        try:
            _check_key(state, request)
        except ApiError as err:
            return error_response(err)
        plan = state.plan
        card = {"id": state.model_id, "object": "model", "created": 0, "owned_by": "localctx",
                "localctx": {"trained_context": state.spec.context_length, "context": plan.context,
                             "plan": plan.to_dict(), "slots": scheduler.streams.capacity,
                             "batching": scheduler.streams.batching, "kv_budget": scheduler.streams.budget,
                             "lanes": scheduler.streams.describe()}}
        return JSONResponse({"object": "list", "data": [card]})

    async def count_tokens(request: Request) -> Response:
        """POST {"messages": [...]} or {"prompt": "..."} → {"count": N, "context": C}: the served
        tokenizer's count, chat template included (the openai backend sizes chunks with it)."""
        try:
            _check_key(state, request)
            body = await _read_json(state, request)
            if not isinstance(body, dict):
                raise ApiError(400, "the request body must be a JSON object")
            prompt = protocol.parse_prompt(body, "messages" in body)
            n = await run_in_threadpool(scheduler.session.count_tokens, prompt)
        except ApiError as err:
            return error_response(err)
        return JSONResponse({"count": n, "context": state.plan.context})

    def completion_route(chat: bool):
        async def endpoint(request: Request) -> Response:
            try:
                _check_key(state, request)
                body = await _read_json(state, request)
                parsed = protocol.parse(body, chat, state.model_id, state.plan, state.spec.context_length)
                return await _serve(state, request, parsed)
            except ApiError as err:
                return error_response(err)
            except ConnectionResetError:  # the client left before the answer: nobody reads this
                return Response(status_code=499)
        return endpoint

    routes = [Route("/health", health), Route("/v1/models", models),
              Route("/v1/chat/completions", completion_route(True), methods=["POST"]),
              Route("/v1/completions", completion_route(False), methods=["POST"]),
              Route("/localctx/count_tokens", count_tokens, methods=["POST"])]
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        scheduler.close()

    return Starlette(routes=routes, lifespan=lifespan)


async def _serve(state: ServeState, request: Request, parsed: protocol.ParsedRequest) -> Response:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()

    def emit(item) -> None:
        try:
            loop.call_soon_threadsafe(inbox.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass

    job = ServeJob(prompt=parsed.prompt, params=parsed.params, emit=emit, context=parsed.context,
                   policy=parsed.policy, timeout_s=state.request_timeout_s)
    if not state.scheduler.submit(job):
        raise ApiError(503, f"the server is busy ({state.scheduler.limits.max_queue} requests waiting); retry "
                            "after the Retry-After seconds", type="server_error", code="queue_full",
                       retry_after=state.scheduler.limits.retry_after_s)
    try:
        first = await _next(inbox, request, job)
    except BaseException:
        job.cancel.set()
        raise
    if isinstance(first, Refused):
        raise _from_refused(first)
    if isinstance(first, Failed):
        raise ApiError(500, first.message, type="server_error")
    ids = protocol.Ids(parsed.chat, state.model_id)
    if parsed.stream:
        return StreamingResponse(_sse(state, ids, parsed, job, inbox, first), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    pieces, event = [first.text], first
    while event.kind != "done":
        item = await _next(inbox, request, job)
        if isinstance(item, Failed):
            raise ApiError(500, item.message, type="server_error")
        if isinstance(item, Refused):
            raise _from_refused(item)
        event = item
        pieces.append(event.text)
    return JSONResponse(protocol.whole(ids, "".join(pieces), event, _plan_of(state, job), parsed.context,
                                       job.timed_out))


def _plan_of(state: ServeState, job: ServeJob) -> Plan:
    """The plan of the lane the job ran in (its KV policy and context), else the served one."""
    return job.lane.plan if job.lane is not None else state.plan


async def _next(inbox: asyncio.Queue, request: Request, job: ServeJob):
    """The scheduler's next item; cancels the job if the client goes away while we wait."""
    while True:
        try:
            return await asyncio.wait_for(inbox.get(), POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel.set()
                raise ConnectionResetError("the client disconnected") from None


def _sse_line(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def _sse(state: ServeState, ids: protocol.Ids, parsed: protocol.ParsedRequest, job: ServeJob,
               inbox: asyncio.Queue, first: GenerationEvent) -> AsyncIterator[str]:
    try:
        if parsed.chat:
            yield _sse_line(protocol.chunk(ids, None, first=True))
        event = first
        while True:
            if event.kind == "done":
                break
            if event.text:
                yield _sse_line(protocol.chunk(ids, event.text))
            item = await inbox.get()
            if isinstance(item, (Failed, Refused)):
                err = ApiError(500, item.message, type="server_error")
                yield _sse_line(err.body())
                return
            event = item
        final = protocol.chunk(ids, event.text or None, reason=protocol.finish_reason(event, job.timed_out))
        final["localctx"] = protocol.extension(event, _plan_of(state, job), parsed.context, job.timed_out)
        yield _sse_line(final)
        if parsed.include_usage:
            yield _sse_line({**protocol.chunk(ids, None), "choices": [], "usage": protocol.usage(event)})
        yield _sse_line("[DONE]")
    finally:
        job.cancel.set()  # a no-op after "done"; a client gone mid-stream stops its generation here
        state.scheduler.wake()
