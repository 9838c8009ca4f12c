"""localctx serve for tests, on 127.0.0.1 only: in a thread (any loaded session), or as a
subprocess of the real CLI (to kill it). Every server here is stopped by its context manager."""
from __future__ import annotations

import contextlib
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from localctx.app.commands.serve import bind
from localctx.app.serve.access import Access
from localctx.app.serve.http import ServeState, build_app
from localctx.app.serve.protocol import RequestRules
from localctx.app.serve.scheduler import Limits, Scheduler
from localctx.app.serve.streams import make_streams

START_TIMEOUT_S = 240  # loading and planning take a minute on a busy 2-core machine


@contextlib.contextmanager
def serve_in_thread(session, model_id: str, parallel: int = 1, limits: Limits = Limits(), api_key=None,
                    max_body: int = 4 * 1024 * 1024, rules: RequestRules = RequestRules(), access: Access | None = None,
                    streams=None, on_state=None):
    """Yields (base URL ending in /v1, the Scheduler). ``streams``: a stream source of the caller's
    (else the one serve would make for ``parallel``); ``on_state``: called with the ServeState."""
    import uvicorn

    streams = streams or make_streams(session, parallel)
    scheduler = Scheduler(session, streams, limits)
    state = ServeState(scheduler=scheduler, model_id=model_id, spec=session.spec, plan=session.plan,
                       access=access or Access(api_key=api_key), rules=rules, max_body_bytes=max_body)
    if on_state is not None:
        on_state(state)
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level="warning", timeout_keep_alive=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1", scheduler
    finally:
        server.should_exit = True
        thread.join(15)
        scheduler.close()
        sock.close()


@contextlib.contextmanager
def serve_subprocess(args: list[str], env: dict | None = None):
    """``localctx serve ARGS --port 0`` in its own process; yields (process, base URL)."""
    cmd = [sys.executable, "-m", "localctx.app.cli", "serve", *args, "--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l) for l in proc.stdout], daemon=True).start()
    try:
        try:
            first = lines.get(timeout=START_TIMEOUT_S)
        except queue.Empty:
            raise RuntimeError("localctx serve printed nothing: " + (proc.stderr.read() if proc.poll() else ""))
        url = first.split()[2]
        proc.startup_line = first  # what the server printed first (its URL, plan and KV)
        assert url.startswith("http://127.0.0.1:"), first
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def finish_one(slots) -> tuple[list[int], object]:
    """Steps ``slots`` (one stream started on them) until nothing is live: its tokens and its last event."""
    tokens, done = [], None
    while slots.active:
        for _, e in slots.step():
            if e.kind == "token":
                tokens.append(e.token)
            else:
                done = e
    return tokens, done
