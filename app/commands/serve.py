"""``localctx serve``: an OpenAI-compatible HTTP server for one local model, with the planner
behind it."""
from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys

from localctx.app.serve.access import Access, is_loopback
from localctx.app.serve.protocol import DEFAULT_MAX_TOKENS_CAP, RequestRules
from localctx.app.session_options import (SLOT_GROW_FROM_TOKENS, SessionRequest, add_cache_reuse_option,
                                          add_session_options, plan_session, resolve_model)
from localctx.kvcache.errors import UserError

KEY_ENV = "LOCALCTX_API_KEY"
REQUEST_TIMEOUT_S = 600.0  # --timeout: the most seconds a request may queue and generate


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                       description="Serve one model over OpenAI's HTTP API (/v1/chat/completions, /v1/completions, "
                                   "/v1/models, /health). Binds 127.0.0.1 unless --host says otherwise; another "
                                   "address needs --api-key.")
    add_session_options(p, remote=False)
    add_cache_reuse_option(p)
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help=f"the most seconds a request may queue and generate (default {REQUEST_TIMEOUT_S:g})")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 = any free port, printed)")
    p.add_argument("--api-key", default=None,
                   help=f"key clients must send as 'Authorization: Bearer KEY'; prefer ${KEY_ENV} (a key given here "
                        "shows in ps). Without a key the server answers only requests addressed to this machine "
                        "(docs/serve.md)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="without a key, also answer requests whose Host is NAME (repeatable; by default only "
                        "localhost and loopback addresses)")
    p.add_argument("--cors", action="append", default=[], metavar="ORIGIN",
                   help="send CORS headers to web pages from ORIGIN, e.g. http://localhost:3000 (repeatable; '*' "
                        "needs a key; default: none)")
    p.add_argument("--parallel", type=int, default=4, metavar="N",
                   help="conversations decoded together (torch: they share the planned KV pool; llama.cpp: "
                        "each gets context/N tokens; windowed llama.cpp policies and MLX serve one at a time; "
                        "default 4)")
    p.add_argument("--queue", type=int, default=32, metavar="N",
                   help="requests that may wait; more are answered 503 with Retry-After (default 32)")
    p.add_argument("--max-body", type=int, default=4 * 1024 * 1024, metavar="BYTES",
                   help="largest request body; larger ones get 413 (default 4 MiB)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS_CAP, metavar="N",
                   help="the most tokens one answer may have: a request asking for more is capped to N and its "
                        f"answer says so (default {DEFAULT_MAX_TOKENS_CAP})")
    p.add_argument("--allow-ignore-eos", action="store_true",
                   help="let requests set ignore_eos (answers run to max_tokens past end-of-text: for benchmarks)")
    p.add_argument("--kv-lanes", type=int, default=0, metavar="N",
                   help="let requests choose their own KV policy (localctx.kv), opening at most N new KV lanes a "
                        "minute (default 0: only the served policy)")
    p.set_defaults(handler=handle)


def check_args(args: argparse.Namespace, api_key: str | None) -> None:
    if not is_loopback(args.host) and not api_key:
        raise UserError(f"--host {args.host} would expose the server beyond this machine without a key; "
                        f"set ${KEY_ENV} (or --api-key KEY, which shows in ps), or bind 127.0.0.1")
    if args.backend == "openai":
        raise UserError("localctx serve runs a local model; choose --backend llamacpp, torch or mlx")
    if "*" in args.cors and not api_key:
        raise UserError("--cors '*' would let any web page use the server; name the origin (--cors "
                        "http://localhost:3000), or set an API key")
    for name, value, low in (("--parallel", args.parallel, 1), ("--queue", args.queue, 1),
                             ("--max-body", args.max_body, 1024), ("--max-tokens", args.max_tokens, 1),
                             ("--kv-lanes", args.kv_lanes, 0)):
        if value < low:
            raise UserError(f"{name} {value} must be at least {low}")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port} is not a port; give 0..65535")
    if args.timeout is not None and args.timeout <= 0:
        raise UserError(f"--timeout {args.timeout} must be more than 0 seconds")


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --port "
                        "(0 picks a free one)") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def access_of(args: argparse.Namespace, api_key: str | None) -> Access:
    return Access(api_key=api_key, allowed_hosts=tuple(h.strip("[]").lower().rstrip(".") for h in args.allow_host),
                  cors_origins=tuple(o.rstrip("/") for o in args.cors))


def handle(args: argparse.Namespace) -> int:
    api_key = args.api_key or os.environ.get(KEY_ENV) or None
    check_args(args, api_key)
    if args.api_key:
        print(f"localctx serve: a key given with --api-key shows in ps to every user of this machine; prefer "
              f"${KEY_ENV}", file=sys.stderr)
    try:
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
        import starlette  # noqa: F401
    except ImportError as exc:
        raise UserError(f"localctx serve needs {exc.name}: pip install starlette uvicorn prometheus-client") from None
    from localctx.app.serve.http import ServeState, build_app
    from localctx.app.serve.scheduler import Limits, Scheduler
    from localctx.app.serve.streams import open_streams

    req = dataclasses.replace(SessionRequest.from_local_args(args, cache_reuse=args.cache_reuse),
                              allocate=args.parallel * SLOT_GROW_FROM_TOKENS,  # KV starts small and grows
                              grow_to_context=True)  # up to --context
    ref, _spec = resolve_model(req)
    sock = bind(args.host, args.port)  # before loading: a taken port fails fast
    planned = plan_session(req)
    threads = torch_serving_threads() if planned.plan.backend == "torch" else None
    session, streams = open_streams(planned, args.parallel)
    scheduler = Scheduler(session, streams, Limits(max_queue=args.queue, kv_lanes_per_min=args.kv_lanes))
    state = ServeState(scheduler=scheduler, model_id=ref.name, spec=session.spec, plan=session.plan,
                       access=access_of(args, api_key), max_body_bytes=args.max_body,
                       rules=RequestRules(max_tokens=args.max_tokens, ignore_eos=args.allow_ignore_eos),
                       request_timeout_s=REQUEST_TIMEOUT_S if args.timeout is None else args.timeout)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    plan = session.plan
    threads_note = f", torch on {threads} of {os.cpu_count()} CPU threads (one core left for HTTP)" if threads else ""
    print(f"localctx serve: http://{shown}:{port}/v1  model {ref.name}, backend {plan.backend}, KV {plan.policy} "
          f"({'exact' if plan.exact else 'lossy'}), context {plan.context:,}, {plan.allocation_words()}, "
          f"{streams.capacity} slot{'s' if streams.capacity > 1 else ''}"
          f"{' batched' if streams.batching else ''}{threads_note}", flush=True)
    return run_server(build_app(state), sock, concurrency=2 * (args.queue + streams.capacity) + 8, session=session)


def torch_serving_threads() -> int | None:
    """torch on the CPU, serving: one thread fewer than the machine's CPUs, unless
    LOCALCTX_TORCH_THREADS says otherwise (returns None then, and on a GPU). The HTTP loop and the
    clients on the same machine need a core; torch's threads, given every core, wait on each other
    whenever one is taken (docs/benchmarks-serve.md: on 2 cores, 8 streams decoded 2.34x one stream
    with 2 threads, 3.34x with 1)."""
    if os.environ.get("LOCALCTX_TORCH_THREADS"):
        return None
    device = os.environ.get("LOCALCTX_TORCH_DEVICE")
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    cpus = os.cpu_count() or 1
    if device != "cpu" or cpus < 2:
        return None
    threads = cpus - 1
    os.environ["LOCALCTX_TORCH_THREADS"] = str(threads)  # read where the torch backend loads (TorchOptions.from_env)
    return threads


def run_server(app, sock: socket.socket, concurrency: int, session) -> int:
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", timeout_keep_alive=5, timeout_graceful_shutdown=5,
                            limit_concurrency=concurrency, access_log=False)
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        session.close()
        sock.close()
    print("localctx serve: stopped", file=sys.stderr)
    return 0
