"""``localctx run --backend openai`` against a server that breaks: a tiny Starlette fake on
127.0.0.1 that answers HTTP 500, fails mid-stream (an error event, or a dropped connection), or
stalls (before its headers, or after a first chunk). Each ends in one line on stderr and a non-zero
exit, never a traceback; ``--timeout`` bounds the wait for a stalled server."""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import pytest

pytest.importorskip("uvicorn", reason="pip install starlette uvicorn")

from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, Response, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from localctx.app.commands.serve import bind  # noqa: E402

MODEL = "broken-remote"
WORDS = ["Once ", "upon "]


def chunk(text: str) -> str:
    body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return f"data: {json.dumps(body)}\n\n"


def broken_app(mode: str, released: threading.Event) -> Starlette:
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 2048}]})

    async def wait_until_released() -> None:
        while not released.is_set():
            await asyncio.sleep(0.05)

    async def completions(request: Request) -> Response:
        await request.body()
        if mode == "status_500":
            return JSONResponse({"error": {"message": "the model crashed", "type": "server_error"}}, status_code=500)
        if mode == "stall_before_headers":
            await wait_until_released()

        async def body():
            for word in WORDS:
                yield chunk(word)
            if mode == "error_event":  # how OpenAI-style servers report a failure once the 200 has gone out
                yield f"data: {json.dumps({'error': {'message': 'CUDA error: an illegal memory access', 'code': 500}})}\n\n"
                return
            if mode == "drop":
                raise RuntimeError("the worker died")  # uvicorn closes the connection mid-body
            await wait_until_released()  # stall_mid_stream

        return StreamingResponse(body(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models),
                             Route("/v1/chat/completions", completions, methods=["POST"]),
                             Route("/v1/completions", completions, methods=["POST"])])


@contextlib.contextmanager
def broken_server(mode: str):
    import uvicorn

    released = threading.Event()
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(broken_app(mode, released), log_level="critical",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        released.set()
        server.should_exit = True
        thread.join(10)
        sock.close()


def one_line_failure(result) -> str:
    assert result.code != 0
    assert "Traceback" not in result.err and result.err.count("\n") == 1, result.err
    return result.err


@pytest.mark.parametrize("mode, said", [("status_500", "HTTP 500: the model crashed"),
                                        ("error_event", "CUDA error: an illegal memory access"),
                                        ("drop", "failed mid-answer")])
def test_a_server_that_fails_is_one_line_and_a_non_zero_exit(cli, mode, said):
    with broken_server(mode) as url:
        result = cli("run", "--backend", "openai", "--endpoint", url, "--max-tokens", "8", "Tell me a story")
    err = one_line_failure(result)
    assert said in err and url in err
    if mode != "status_500":
        assert "failed mid-answer" in err  # the text already shown is not sent again elsewhere


@pytest.mark.parametrize("mode", ["stall_before_headers", "stall_mid_stream"])
def test_timeout_ends_a_stalled_request_with_one_line(cli, mode):
    with broken_server(mode) as url:
        started = time.monotonic()
        result = cli("run", "--backend", "openai", "--endpoint", url, "--timeout", "1", "--max-tokens", "8",
                     "Tell me a story")
        waited = time.monotonic() - started
    err = one_line_failure(result)
    assert "timed out" in err and url in err
    assert waited < 10  # the 1 s --timeout, not the 600 s default


def test_timeout_is_refused_for_a_local_model(cli):
    result = cli("run", "--backend", "fake", "--timeout", "5", "hi")
    assert result.code != 0 and "--timeout bounds the wait for a server" in one_line_failure(result)
