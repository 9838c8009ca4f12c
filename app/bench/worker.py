"""Measurements run in worker subprocesses, one per series, kept alive for the whole bench.

A worker reads one JSON request per line on stdin and answers one JSON sample per line. Its own
stdout is moved to stderr at start, so anything a native library prints cannot corrupt the answers;
stderr goes to a log file in the output folder. One process per series means a crash costs that
measurement only, the baseline process never loads a localctx backend, and peak memory belongs to
one series. Run as ``python -m localctx.app.bench.worker``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from localctx.app.bench.measure import MeasureRequest, Sample, measure
from localctx.app.bench.memory import PeakTracker


def serve() -> int:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # native prints land in the log, not in the protocol
    sys.stdout = sys.stderr
    tracker = PeakTracker()
    for line in sys.stdin:
        if not line.strip():
            continue
        sample = measure(MeasureRequest.from_dict(json.loads(line)), tracker)
        answers.write(json.dumps(sample.to_dict()) + "\n")
    return 0


class Worker:
    """The parent's handle on one worker process; restarts it after a crash."""

    def __init__(self, name: str, log_path: Path):
        self.name = name
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "a")
        try:
            return subprocess.Popen([sys.executable, "-m", "localctx.app.bench.worker"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1)
        finally:
            log.close()

    def measure(self, req: MeasureRequest) -> Sample:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        try:
            self.proc.stdin.write(json.dumps(req.to_dict()) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            code = self.proc.wait()
            self.proc = None
            return Sample(error=f"the {self.name} worker exited with code {code} (log: {self.log_path})")
        return Sample.from_dict(json.loads(line))

    def close(self) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
            self.proc = None


if __name__ == "__main__":  # pragma: no cover - the subprocess entry point
    sys.exit(serve())
