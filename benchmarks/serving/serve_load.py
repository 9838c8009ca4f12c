"""Load on ``localctx serve`` through the official openai client, all on 127.0.0.1.

Starts the server as a subprocess (``--port 0``), then measures, streamed:

1. one client alone: time to first token (TTFT) and tokens/s, over a few requests;
2. ``--streams`` clients at once (one request each, started together): aggregate tokens/s
   against one client, both as generated tokens over the wall time from the first request
   sent to the last token received; and the decode phase alone: Σ(tokens − 1) over the time
   from the first first token to the last token, against one client's decode rate (per
   request (tokens − 1) ÷ (last token − first token), median), so prefill does not blur it; and
   the window in which all of them were decoding (from the last first token to the first last
   token), so streams that ended early do not leave fewer streams in the figure;
3. ``--clients`` clients (default 16) sending ``--requests`` requests each, bounded: p50/p99
   TTFT, aggregate tokens/s, errors, and the server's resident memory before and after;
4. a follow-up turn in a conversation with ``--history`` tokens of history: TTFT of the
   cold request (nothing cached) against the follow-up that extends it (its KV reused);
5. with ``--plain-llamacpp``, before the server starts: plain llama-cpp-python decoding one greedy
   stream of the same GGUF (``--max-tokens`` tokens past any end-of-text, same context, every CPU
   thread), median of three: the absolute single-stream figure the batched server's figures
   stand beside (a ratio to the server's own one client says nothing about it).

    python benchmarks/serving/serve_load.py --backend torch --parallel 8 --json docs/results/serve/benchmarks-serve-torch.json

Every figure is measured here; nothing is extrapolated. Keep runs short on a shared machine."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass

import openai
import psutil
from server_process import launch

WORDS = ("the cache keeps recent tokens while sinks hold the start and quantized keys save memory so long "
         "contexts fit in the budget of a small machine").split()


@dataclass
class Sample:
    ttft_s: float
    total_s: float
    tokens: int
    cached_tokens: int
    started: float
    ended: float
    first_token: float | None = None  # when the first and the last content chunk arrived
    last_token: float | None = None
    error: str | None = None
    token_times: list[float] | None = None  # when each content chunk arrived


    @property
    def decode_tok_s(self) -> float | None:
        """(tokens − 1) ÷ (last token − first token): the decode rate, prefill left out."""
        if self.error or self.tokens < 2 or self.first_token is None or self.last_token <= self.first_token:
            return None
        return (self.tokens - 1) / (self.last_token - self.first_token)


def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = ["--backend", args.backend, "--parallel", str(args.parallel), "--queue", str(max(8, args.clients * 2))]
    if args.model:
        cmd += ["-m", args.model]
    if args.kv:
        cmd += ["--kv", args.kv]
    if args.context:
        cmd += ["--context", str(args.context)]
    if args.ignore_eos:
        cmd += ["--allow-ignore-eos"]  # off by default: the operator lets requests run past end-of-text
    return launch(cmd)


def ask(client: openai.OpenAI, model: str, messages: list, max_tokens: int, ignore_eos: bool = False) -> Sample:
    started = time.perf_counter()
    first = last = None
    tokens = cached = 0
    times: list[float] = []
    try:
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True} if ignore_eos else None)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                last = time.perf_counter()
                first = first or last
                times.append(last)
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
                details = chunk.usage.prompt_tokens_details
                cached = (details.cached_tokens or 0) if details else 0
    except openai.OpenAIError as exc:
        now = time.perf_counter()
        return Sample(now - started, now - started, 0, 0, started, now, error=f"{type(exc).__name__}: {exc}")
    ended = time.perf_counter()
    return Sample((first or ended) - started, ended - started, tokens, cached, started, ended, first, last,
                  token_times=times)


def plain_llamacpp(args) -> dict:
    """One greedy stream of plain llama-cpp-python on the same GGUF: decode tok/s (first token to the
    last, ``--max-tokens`` tokens, end-of-text not stopping it), median of three runs."""
    from llama_cpp import Llama

    from localctx.backends.models.ref import bundled_default_path

    path = args.model or str(bundled_default_path())
    threads = os.cpu_count() or 1
    llm = Llama(model_path=path, n_ctx=args.context, n_threads=threads, n_threads_batch=threads, verbose=False)
    prompt = llm.tokenize(question(1)[0]["content"].encode(), add_bos=True)
    rates = []
    for _ in range(3):
        times = []
        for _token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, reset=True):
            times.append(time.perf_counter())
            if len(times) >= args.max_tokens:
                break
        rates.append((len(times) - 1) / (times[-1] - times[0]))
    llm.close()
    return {"model": path, "context": args.context, "threads": threads, "tokens": args.max_tokens,
            "decode_tok_s_runs": [round(r, 2) for r in rates], "decode_tok_s_median": round(statistics.median(rates), 2)}


def question(i: int, n_words: int = 24) -> list:
    words = [WORDS[(i * 7 + k) % len(WORDS)] for k in range(n_words)]
    return [{"role": "user", "content": f"Request {i}: " + " ".join(words) + ". Continue the text."}]


def concurrent(client, model, n_clients: int, n_requests: int, max_tokens: int, offset: int,
               ignore_eos: bool = False) -> list[Sample]:
    samples: list[Sample] = []
    lock = threading.Lock()
    barrier = threading.Barrier(n_clients)

    def run(c: int) -> None:
        barrier.wait()
        for r in range(n_requests):
            s = ask(client, model, question(offset + c * n_requests + r), max_tokens, ignore_eos)
            with lock:
                samples.append(s)

    threads = [threading.Thread(target=run, args=(c,)) for c in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return samples


def aggregate_tok_s(samples: list[Sample]) -> float:
    ok = [s for s in samples if s.error is None]
    if not ok:
        return 0.0
    wall = max(s.ended for s in ok) - min(s.started for s in ok)
    return sum(s.tokens for s in ok) / wall


def decode_phase_tok_s(samples: list[Sample]) -> float:
    """Σ(tokens − 1) ÷ (last token − first first token): what the streams decoded together once
    the first of them had its first token (later prefills that stall decoding count against it)."""
    ok = [s for s in samples if s.error is None and s.first_token is not None and s.tokens >= 1]
    if not ok:
        return 0.0
    wall = max(s.last_token for s in ok) - min(s.first_token for s in ok)
    return sum(s.tokens - 1 for s in ok) / wall if wall > 0 else 0.0


def all_decoding_tok_s(samples: list[Sample]) -> tuple[float, float]:
    """(tok/s, seconds) over the window in which every stream of the phase was decoding: from the
    last stream's first token to the first stream's last token, the content chunks that arrived
    inside it, over its length. Streams that end early (an end-of-text before max_tokens) leave
    fewer streams decoding after them, which the whole-phase rate mixes in; this one does not."""
    ok = [s for s in samples if s.error is None and s.token_times and len(s.token_times) >= 2]
    if len(ok) != len(samples) or not ok:
        return 0.0, 0.0
    start = max(s.token_times[0] for s in ok)
    end = min(s.token_times[-1] for s in ok)
    if end <= start:
        return 0.0, 0.0
    inside = sum(sum(1 for t in s.token_times if start < t <= end) for s in ok)
    return inside / (end - start), end - start


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def history(n_tokens_hint: int, seed: int) -> list:
    """About ``n_tokens_hint`` tokens of prior conversation (one word ≈ one to two tokens)."""
    words = [WORDS[(seed * 13 + k * 5) % len(WORDS)] for k in range(n_tokens_hint)]  # ≈ one token a word
    text = " ".join(words)
    return [{"role": "user", "content": f"Conversation {seed}. Read this: {text}"},
            {"role": "assistant", "content": "I have read it."}]


def follow_up(client, model, args) -> dict:
    cold_ttft, warm_ttft, cached, prompt = [], [], [], []
    for seed in range(args.follow_rounds):
        conv = history(args.history, 1000 + seed) + [{"role": "user", "content": "Summarise it in one line."}]
        cold = ask(client, model, conv, args.follow_tokens)
        reply = client.chat.completions.create(model=model, messages=conv, max_tokens=args.follow_tokens,
                                               temperature=0)
        conv2 = conv + [{"role": "assistant", "content": reply.choices[0].message.content},
                        {"role": "user", "content": "And the second line?"}]
        warm = ask(client, model, conv2, args.follow_tokens)
        cold_ttft.append(cold.ttft_s)
        warm_ttft.append(warm.ttft_s)
        cached.append(warm.cached_tokens)
        prompt.append(reply.usage.prompt_tokens)
    cold_m, warm_m = statistics.median(cold_ttft), statistics.median(warm_ttft)
    return {"history_prompt_tokens": prompt, "cold_ttft_s": cold_ttft, "follow_up_ttft_s": warm_ttft,
            "follow_up_cached_tokens": cached, "cold_ttft_median_s": round(cold_m, 4),
            "follow_up_ttft_median_s": round(warm_m, 4), "speedup": round(cold_m / warm_m, 2) if warm_m else None}


def summary(samples: list[Sample]) -> dict:
    ok = [s for s in samples if s.error is None]
    ttft = [s.ttft_s for s in ok]
    return {"requests": len(samples), "errors": len(samples) - len(ok),
            "error_messages": sorted({s.error for s in samples if s.error})[:5],
            "ttft_p50_s": round(pct(ttft, 0.5), 4) if ttft else None,
            "ttft_p99_s": round(pct(ttft, 0.99), 4) if ttft else None,
            "generated_tokens": sum(s.tokens for s in ok), "aggregate_tok_s": round(aggregate_tok_s(samples), 2),
            "decode_phase_tok_s": round(decode_phase_tok_s(samples), 2)}


def versus(samples: list[Sample], one_tok_s: float, one_decode_tok_s: float | None) -> dict:
    """The phase's aggregates divided by one client's: whole requests, and the decode phase."""
    all_rate, window = all_decoding_tok_s(samples)
    return {"vs_one_client": round(aggregate_tok_s(samples) / one_tok_s, 2) if one_tok_s else None,
            "decode_vs_one_client": round(decode_phase_tok_s(samples) / one_decode_tok_s, 2)
            if one_decode_tok_s else None,
            "all_decoding_tok_s": round(all_rate, 2), "all_decoding_window_s": round(window, 2),
            "all_decoding_vs_one_client": round(all_rate / one_decode_tok_s, 2)
            if one_decode_tok_s and all_rate else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="torch")
    p.add_argument("-m", "--model", default=None)
    p.add_argument("--kv", default=None)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--parallel", type=int, default=8)
    p.add_argument("--streams", type=int, default=8, help="concurrent streams compared with one (default 8; 0 skips)")
    p.add_argument("--clients", type=int, default=16, help="clients in the load phase (default 16; 0 skips)")
    p.add_argument("--requests", type=int, default=2, help="requests per client in the load phase")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per answer (default 128, so that decoding "
                   "dominates the phases' time)")
    p.add_argument("--ignore-eos", action="store_true", help="every answer runs --max-tokens (the request's "
                   "ignore_eos), so every stream decodes the same length in phases 1-3")
    p.add_argument("--single-requests", type=int, default=3)
    p.add_argument("--history", type=int, default=4096, help="tokens of history for the follow-up turn")
    p.add_argument("--follow-rounds", type=int, default=2)
    p.add_argument("--follow-tokens", type=int, default=16)
    p.add_argument("--plain-llamacpp", action="store_true", help="also measure plain llama-cpp-python's single "
                   "stream on the same GGUF, before the server starts")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args()

    load_start = os.getloadavg()
    plain = plain_llamacpp(args) if args.plain_llamacpp else None
    proc, url = start_server(args)
    server = psutil.Process(proc.pid)
    try:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        card = client.models.list().data[0].model_extra.get("localctx", {})
        ask(client, model, question(0), 4)  # warm-up: first-call costs out of the figures
        rss_start = server.memory_info().rss
        single = [ask(client, model, question(1 + i), args.max_tokens, args.ignore_eos)
                  for i in range(args.single_requests)]
        one_tok_s = statistics.median(s.tokens / (s.ended - s.started) for s in single if s.error is None)
        decode_rates = [r for r in (s.decode_tok_s for s in single) if r is not None]
        one_decode_tok_s = statistics.median(decode_rates) if decode_rates else None
        together = concurrent(client, model, args.streams, 1, args.max_tokens, 100, args.ignore_eos) \
            if args.streams else []
        load = concurrent(client, model, args.clients, args.requests, args.max_tokens, 200, args.ignore_eos) \
            if args.clients else []
        rss_end_load = server.memory_info().rss
        follow = follow_up(client, model, args) if args.history else None
        rss_end = server.memory_info().rss
    finally:
        proc.terminate()
        proc.wait(30)
    result = {
        "command": "python benchmarks/serving/serve_load.py " + " ".join(sys.argv[1:]),
        "server": {"backend": args.backend, "model": model, "parallel": args.parallel, "plan": card.get("plan"),
                   "batching": card.get("batching"), "slots": card.get("slots")},
        "machine": {"cpus": os.cpu_count(),
                    "load_average_start": [round(x, 2) for x in load_start],
                    "load_average_end": [round(x, 2) for x in os.getloadavg()]},
        "max_tokens": args.max_tokens,
        "ignore_eos": args.ignore_eos,
        "one_client": {**summary(single), "tok_s_median": round(one_tok_s, 2),
                       "decode_tok_s_median": round(one_decode_tok_s, 2) if one_decode_tok_s else None},
        "streams": {"n": args.streams, **summary(together), **versus(together, one_tok_s, one_decode_tok_s)}
        if together else None,
        "load": {"clients": args.clients, "requests_per_client": args.requests, **summary(load),
                 **versus(load, one_tok_s, one_decode_tok_s)} if load else None,
        "rss_bytes": {"start": rss_start, "after_load": rss_end_load, "end": rss_end},
        "follow_up": follow,
        "plain_llamacpp_one_stream": plain,
        "samples": {"one_client": [asdict(s) for s in single], "streams": [asdict(s) for s in together],
                    "load": [asdict(s) for s in load]},
    }
    text = json.dumps(result, indent=1)
    if args.json:
        with open(args.json + ".tmp", "w") as fh:
            fh.write(text)
        os.replace(args.json + ".tmp", args.json)
    brief = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(brief, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
