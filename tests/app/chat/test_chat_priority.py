"""The chat's UI process gives the model's process the cores first (app/chat/app.py, yield_to_model):
once the worker has started, `localctx chat` lowers the UI's priority; the worker keeps its own."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(os.name != "posix", reason="nice values are POSIX")

SCRIPT = """
import os, sys, threading
from localctx.app.chat.app import UI_NICE, yield_to_model
before = os.nice(0)
child = os.fork()
if child == 0:  # started before the UI yields, as the model's process is
    import time; time.sleep(0.5); os._exit(os.nice(0) - before)
yield_to_model() if sys.argv[1] == "default" else yield_to_model(int(sys.argv[1]))
seen = []
t = threading.Thread(target=lambda: seen.append(os.nice(0)))  # what Textual starts afterwards
t.start(); t.join()
_, status = os.waitpid(child, 0)
print(UI_NICE, os.nice(0) - before, seen[0] - before, os.waitstatus_to_exitcode(status))
"""


@pytest.mark.parametrize("arg", ["default", "0"])
def test_the_ui_yields_to_the_model_process_and_the_model_keeps_its_priority(arg):
    if os.nice(0) > 9:
        pytest.skip("this process already runs at nice > 9")
    out = subprocess.run([sys.executable, "-c", SCRIPT, arg], capture_output=True, text=True, timeout=60, check=True)
    ui_nice, main, thread, model = map(int, out.stdout.split())
    want = ui_nice if arg == "default" else 0
    assert ui_nice > 0 and (main, thread, model) == (want, want, 0)
