"""``localctx serve`` as a child process on 127.0.0.1 (``--port 0``), for the serving benchmarks
(serve_load.py, soak.py): starts it with the given options and waits for the line that names its
address."""
from __future__ import annotations

import queue
import subprocess
import sys
import threading


def launch(options: list[str]) -> tuple[subprocess.Popen, str]:
    """Starts ``localctx serve --host 127.0.0.1 --port 0 OPTIONS``: (the process, its base URL)."""
    cmd = [sys.executable, "-m", "localctx.app.cli", "serve", "--host", "127.0.0.1", "--port", "0", *options]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        first = lines.get(timeout=300)
    except queue.Empty:
        proc.kill()
        raise SystemExit("localctx serve did not start: " + proc.stderr.read())
    print(first.strip(), file=sys.stderr)
    return proc, first.split()[2]
