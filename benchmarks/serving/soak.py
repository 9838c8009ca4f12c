"""A bounded soak of ``localctx serve``: many clients for a fixed time, a share of them hostile.

Starts the server as a subprocess on 127.0.0.1 (``--port 0``), then ``--clients`` threads send
requests back to back for ``--seconds``. Each request is, by turns of a seeded random draw:

- valid (two in three by default): a chat completion, streamed or whole, greedy or sampled with a
  seed, ``--max-tokens``-bounded; it must be answered in full (200 and a finish reason);
- malformed (half of the rest): one of a broken body, NaN, a seed of 2**64, nesting 10,000 deep,
  a text/plain body, a foreign Host, a foreign Origin, an out-of-range number; it must get a 4xx;
- cancelled (the other half): a streamed request whose client reads a chunk or two and closes the
  connection, or one that closes before the first byte.

It checks what the issue asks of a server left running on a desktop: zero 5xx, every valid request
answered, every slot free at the end (/health and /metrics), and the server's resident memory
flat: its growth from the end of the warm-up (``--warmup`` seconds) to the end within 10 %. It
prints and writes one JSON (``--json``):

    python benchmarks/serving/soak.py --backend llamacpp --parallel 4 --json docs/results/serve/soak-llamacpp.json

Every figure is measured here. Keep it bounded on a shared machine; the JSON records the load."""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from urllib.parse import urlsplit

import psutil
from server_process import launch
from prometheus_client.parser import text_string_to_metric_families

TOPICS = ("the cache", "a window of tokens", "quantized keys", "attention sinks", "a small machine", "long contexts")
MALFORMED = ("not json", "nan", "seed 2**64", "deep", "text/plain", "foreign host", "foreign origin", "top_p 7")


def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = ["--backend", args.backend, "--parallel", str(args.parallel), "--queue", str(2 * args.clients),
           "--max-tokens", str(args.max_tokens), "--context", str(args.context)]
    if args.model:
        cmd += ["-m", args.model]
    if args.kv:
        cmd += ["--kv", args.kv]
    return launch(cmd)


class Client:
    def __init__(self, url: str, rng: random.Random, args):
        parts = urlsplit(url)
        self.host, self.port, self.rng, self.args = parts.hostname, parts.port, rng, args

    def _conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=300)

    def _body(self, stream: bool) -> dict:
        r = self.rng
        body = {"messages": [{"role": "user", "content": f"Say something about {r.choice(TOPICS)}."}],
                "max_tokens": r.randint(4, self.args.max_tokens), "stream": stream}
        if r.random() < 0.5:
            body.update(temperature=0.8, seed=r.randint(-2 ** 63, 2 ** 63 - 1))
        else:
            body["temperature"] = 0
        return body

    def valid(self) -> tuple[str, int, bool]:
        stream = self.rng.random() < 0.5
        conn = self._conn()
        try:
            conn.request("POST", "/v1/chat/completions", body=json.dumps(self._body(stream)),
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            raw = r.read().decode("utf-8", "replace")
        finally:
            conn.close()
        if r.status != 200:
            try:
                code = json.loads(raw)["error"]["code"]
            except (ValueError, KeyError, TypeError):
                code = None
            return f"valid, refused: {code}", r.status, False
        if stream:
            chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
            done = any(c.get("choices") and c["choices"][0].get("finish_reason") for c in chunks)
            return "valid", r.status, done and raw.rstrip().endswith("data: [DONE]")
        return "valid", r.status, bool(json.loads(raw)["choices"][0]["finish_reason"])

    def malformed(self) -> tuple[str, int, bool]:
        kind = self.rng.choice(MALFORMED)
        headers = {"Content-Type": "application/json"}
        body = json.dumps(self._body(False))
        if kind == "not json":
            body = body[: len(body) // 2]
        elif kind == "nan":
            body = body[:-1] + ', "temperature": NaN}'  # the last key: a duplicate's last value is the one read
        elif kind == "seed 2**64":
            body = json.dumps({**self._body(False), "temperature": 1, "seed": 2 ** 64})
        elif kind == "deep":
            body = '{"messages": ' + "[" * 10_000 + "]" * 10_000 + "}"
        elif kind == "text/plain":
            headers["Content-Type"] = "text/plain"
        elif kind == "foreign host":
            headers["Host"] = "evil.example"
        elif kind == "foreign origin":
            headers["Origin"] = "http://evil.example"
        else:
            body = json.dumps({**self._body(False), "top_p": 7})
        conn = self._conn()
        try:
            conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
            r = conn.getresponse()
            r.read()
        finally:
            conn.close()
        return f"malformed: {kind}", r.status, 400 <= r.status < 500

    def cancelled(self) -> tuple[str, int, bool]:
        conn = self._conn()
        early = self.rng.random() < 0.3  # leaves before the first byte
        try:
            conn.request("POST", "/v1/chat/completions", body=json.dumps({**self._body(True), "max_tokens":
                                                                          self.args.max_tokens}),
                         headers={"Content-Type": "application/json"})
            if early:
                return "cancelled before the first byte", 0, True
            r = conn.getresponse()
            if r.status == 200:
                for _ in range(self.rng.randint(1, 3)):
                    r.fp.readline()
            return "cancelled mid-stream", r.status, r.status == 200
        finally:
            conn.close()


def get(url: str, path: str) -> str:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="llamacpp")
    p.add_argument("-m", "--model", default=None)
    p.add_argument("--kv", default=None)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--warmup", type=float, default=20.0, help="seconds before the first RSS that counts")
    p.add_argument("--hostile", type=float, default=1 / 3, help="share of requests malformed or cancelled")
    p.add_argument("--max-tokens", type=int, default=32, help="the server's --max-tokens and the answers' bound")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args()

    load_start = os.getloadavg()
    proc, url = start_server(args)
    server = psutil.Process(proc.pid)
    results: list[tuple[str, int, bool, float]] = []
    rss: list[tuple[float, int]] = []
    lock = threading.Lock()
    started = time.monotonic()
    stop_at = started + args.seconds

    def run(k: int) -> None:
        client = Client(url, random.Random(args.seed * 1000 + k), args)
        while time.monotonic() < stop_at:
            draw = client.rng.random()
            t0 = time.monotonic()
            try:
                if draw >= args.hostile:
                    out = client.valid()
                elif draw < args.hostile / 2:
                    out = client.malformed()
                else:
                    out = client.cancelled()
            except (OSError, http.client.HTTPException, ValueError) as exc:
                out = (f"client error: {type(exc).__name__}", -1, False)
            with lock:
                results.append((*out, time.monotonic() - t0))

    def sample_rss() -> None:
        while time.monotonic() < stop_at + 5:
            rss.append((round(time.monotonic() - started, 1), server.memory_info().rss))
            time.sleep(5)

    try:
        threads = [threading.Thread(target=run, args=(k,)) for k in range(args.clients)]
        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        settle = time.monotonic()
        health = json.loads(get(url.removesuffix("/v1"), "/health"))
        while (health["active"] or health["queued"]) and time.monotonic() - settle < 10:
            time.sleep(0.2)
            health = json.loads(get(url.removesuffix("/v1"), "/health"))
        metrics = {f.name: f for f in text_string_to_metric_families(get(url.removesuffix("/v1"), "/metrics"))}
        rss.append((round(time.monotonic() - started, 1), server.memory_info().rss))
    finally:
        proc.terminate()
        proc.wait(30)

    kinds = Counter(kind.split(":")[0].split(",")[0] for kind, *_ in results)
    statuses = Counter(status for _, status, _, _ in results)
    valid = [r for r in results if r[0].startswith("valid")]
    warm = [b for t, b in rss if t >= args.warmup]
    growth = (rss[-1][1] - warm[0]) / warm[0] if warm else None
    by_status = {}
    for s in metrics["localctx_requests"].samples:
        if s.name == "localctx_requests_total":
            by_status[s.labels["status"]] = by_status.get(s.labels["status"], 0) + int(s.value)
    result = {
        "command": "python benchmarks/serving/soak.py " + " ".join(sys.argv[1:]),
        "server": {"backend": args.backend, "parallel": args.parallel, "context": args.context, "kv": args.kv,
                   "max_tokens": args.max_tokens, "queue": 2 * args.clients},
        "machine": {"cpus": os.cpu_count(), "load_average_start": [round(x, 2) for x in load_start],
                    "load_average_end": [round(x, 2) for x in os.getloadavg()]},
        "clients": args.clients, "seconds": args.seconds, "hostile_share": round(args.hostile, 3),
        "requests": len(results), "by_kind": dict(kinds), "by_status": {str(k): v for k, v in sorted(statuses.items())},
        "by_detail": dict(Counter(kind for kind, *_ in results)),
        "server_5xx": sum(v for k, v in statuses.items() if k >= 500),
        "server_counted_by_status": by_status,
        "valid": len(valid), "valid_answered": sum(1 for r in valid if r[1] == 200 and r[2]),
        "valid_seconds_median": round(statistics.median(r[3] for r in valid), 3) if valid else None,
        "malformed_refused_4xx": sum(1 for r in results if r[0].startswith("malformed") and r[2]),
        "malformed": sum(1 for r in results if r[0].startswith("malformed")),
        "client_errors": sum(1 for r in results if r[1] == -1),
        "end": {"health": health, "slots_busy": metrics["localctx_slots_busy"].samples[0].value,
                "queue_depth": metrics["localctx_queue_depth"].samples[0].value},
        "rss_bytes": rss, "rss_growth_after_warmup": round(growth, 4) if growth is not None else None,
    }
    result["passed"] = {
        "zero_5xx": result["server_5xx"] == 0,
        "every_valid_answered": result["valid_answered"] == result["valid"],
        "every_malformed_refused_4xx": result["malformed_refused_4xx"] == result["malformed"],
        "slots_free_at_end": health["active"] == 0 and health["queued"] == 0 and result["end"]["slots_busy"] == 0,
        "rss_flat_within_10pct": growth is not None and abs(growth) <= 0.10,
    }
    text = json.dumps(result, indent=1)
    if args.json:
        with open(args.json + ".tmp", "w") as fh:
            fh.write(text)
        os.replace(args.json + ".tmp", args.json)
    print(text)
    return 0 if all(result["passed"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
