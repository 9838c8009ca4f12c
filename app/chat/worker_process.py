"""The chat's model in its own process: generation runs outside the UI's interpreter.

ProcessEngine has ChatEngine's interface (load, answer, stop, reset, replan, close) and the same
results (Loaded, Streamed, Failed, Notice, Replanned), but the session lives in a child process
started with ``spawn``. Commands go down one pipe, results come back up it (streamed tokens in
batches, at most one message per BATCH_S); a reader thread in the UI process hands each result to
``emit``. The UI's event loop and the decoder no longer share a GIL,
so drawing a frame never delays the next token (docs/benchmarks.md, "The chat against `localctx run`").

In the child, a reader thread takes commands off the pipe: ``stop`` sets the running answer's cancel
event at once, the rest queue for the main thread, which owns the session (one command at a time,
as ChatEngine's lock does). A child that dies is reported as one line: a load that fails, a Failed
for the answer in progress, or a Notice when idle; after that every request says the same line."""
from __future__ import annotations

import multiprocessing
import os
import queue
import threading
import time
from dataclasses import dataclass, replace

from localctx.app.chat.chat_engine import ChatEngine, Emit, Failed, Loaded, Notice, Replanned, Streamed
from localctx.app.session_options import PlannedSession, SessionRequest, open_session
from localctx.backends.base import GenerationParams, Session
from localctx.kvcache.errors import RuntimeFailure
from localctx.kvcache.model_spec import ModelSpec
from localctx.kvcache.plan import Plan

# The child sends streamed tokens in batches, at most one message per BATCH_S (the first token and the
# final event go at once): the UI draws at most 10 frames a second anyway, and each message costs the UI
# process a wake-up and an unpickle, CPU taken from the decoder's threads on a 2-core machine.
BATCH_S = 0.1
CLOSE_WAIT_S = 10.0  # how long close() waits for the child to release the model before ending it
ORPHAN_EXIT_S = 5.0  # a child whose UI process went away exits after at most this long


@dataclass(frozen=True)
class Opener:
    """What the child opens; picklable, since spawn sends it to the child."""
    planned: PlannedSession  # loaded at start
    request: SessionRequest  # re-planned with another --kv by /kv

    def load(self) -> Session:
        return self.planned.load()

    def reopen(self, kv: str | None) -> Session:
        return open_session(replace(self.request, kv=kv))


@dataclass(frozen=True)
class SessionInfo:
    """What the UI process knows of the child's session: what SessionFacts.of reads."""
    backend_name: str
    spec: ModelSpec
    plan: Plan
    decode_threads: int | None  # Session.decode_threads: the chat's frames pace themselves by it

    @classmethod
    def of(cls, session: Session) -> "SessionInfo":
        return cls(session.backend_name, session.spec, session.plan, session.decode_threads)


@dataclass(frozen=True)
class StreamBatch:
    """Streamed events of one answer, in order, sent as one message, with what the child's session has
    allocated by then: (tokens, KV bytes), its plan's ``grow_to`` arguments; the UI's copy of the plan
    follows it (the KV panel's "of X allocated" after the context grew, or as MLX's buffers fill)."""
    turn: int
    events: tuple
    allocation: tuple[int, int] | None = None


class Batcher:
    """Collects one answer's Streamed events and says when to send them: the answer's first at once,
    then at most once per ``interval``, the final event at once; anything else flushes what is held."""

    def __init__(self, interval: float = BATCH_S, clock=time.monotonic):
        self.interval = interval
        self.clock = clock
        self.turn: int | None = None
        self.events: list = []
        self.sent_at = float("-inf")

    def add(self, item: Streamed) -> list[object]:
        """The messages to send now (possibly none) for this streamed event."""
        out = []
        if item.turn != self.turn:  # another answer: the last one's events go first, this one's first token at once
            out, self.sent_at = self.flush(), float("-inf")
        self.turn = item.turn
        self.events.append(item.event)
        if item.event.kind == "done":
            out += self.flush()
            self.sent_at = float("-inf")  # the next answer's first token goes at once
        elif self.clock() - self.sent_at >= self.interval:
            out += self.flush()
        return out

    def flush(self) -> list[object]:
        if not self.events:
            return []
        batch = StreamBatch(self.turn, tuple(self.events))
        self.events = []
        self.sent_at = self.clock()
        return [batch]


# -- the child ---------------------------------------------------------------------------------
class _Child:
    def __init__(self, conn, opener: Opener, params: GenerationParams):
        self.conn = conn
        self.engine = ChatEngine(opener.reopen, params)
        self.opener = opener
        self.commands: queue.Queue = queue.Queue()
        self.send_lock = threading.Lock()
        self.cancel_lock = threading.Lock()
        self.stopped_upto = 0  # answers of turns up to this one are stopped (a stop may arrive before its answer)
        self.running_turn = 0
        self.cancel: threading.Event | None = None
        self.batcher = Batcher()

    def send(self, payload: object) -> None:
        """Results for the UI; a Loaded or Replanned carries the session's facts, not the session;
        streamed events go in batches (Batcher)."""
        if isinstance(payload, Loaded) and payload.session is not None:
            payload = Loaded(SessionInfo.of(payload.session))
        elif isinstance(payload, Replanned) and payload.session is not None:
            payload = Replanned(SessionInfo.of(payload.session), payload.message)
        with self.send_lock:
            messages = self.batcher.add(payload) if isinstance(payload, Streamed) else \
                self.batcher.flush() + [payload]
            session = self.engine.session
            if session is not None:
                plan = session.plan
                messages = [replace(m, allocation=(plan.allocated_context, plan.allocated_bytes))
                            if isinstance(m, StreamBatch) else m for m in messages]
            try:
                for message in messages:
                    self.conn.send(message)
            except (OSError, EOFError):
                pass  # the UI process has gone: the reader thread ends this process

    def read(self) -> None:
        while True:
            try:
                command = self.conn.recv()
            except (OSError, EOFError):
                command = ("close",)  # the UI process went away without closing: stop and exit
                threading.Timer(ORPHAN_EXIT_S, os._exit, (0,)).start()
            if command[0] == "stop":
                self.stop(command[1])
            else:
                if command[0] == "close":
                    self.stop(self.running_turn)
                self.commands.put(command)
            if command[0] == "close":
                return

    def stop(self, turn: int) -> None:
        with self.cancel_lock:
            self.stopped_upto = max(self.stopped_upto, turn)
            if self.cancel is not None and self.running_turn <= self.stopped_upto:
                self.cancel.set()

    def new_cancel(self, turn: int) -> threading.Event:
        with self.cancel_lock:
            self.running_turn, self.cancel = turn, threading.Event()
            if turn <= self.stopped_upto:
                self.cancel.set()
            return self.cancel

    def run(self) -> None:
        threading.Thread(target=self.read, name="chat-worker-commands", daemon=True).start()
        while True:
            command = self.commands.get()
            name = command[0]
            if name == "load":
                self.engine.load(self.opener.load, self.send)
            elif name == "answer":
                _, turn, messages = command
                self.engine.answer(turn, messages, self.new_cancel(turn), self.send)
            elif name == "reset":
                self.engine.reset()
            elif name == "replan":
                self.engine.replan(command[1], self.send)
            elif name == "close":
                self.engine.close()
                return


def child_main(conn, opener: Opener, params: GenerationParams) -> None:
    """The child process's entry point (a module-level function: spawn imports it by name). Its
    stdout and stderr would draw over the chat's screen: they go to the null device (what the user
    needs to know comes back as results)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    _Child(conn, opener, params).run()
    conn.close()


# -- the UI process ----------------------------------------------------------------------------
class ProcessEngine:
    """ChatEngine's interface, with the session in a spawned child process."""
    decodes_here = False

    def __init__(self, opener: Opener, params: GenerationParams):
        """Starts the child, which loads the planned model at once, while the UI comes up. Called
        before Textual takes over sys.stderr: spawning needs its file descriptor."""
        self.opener = opener
        self.params = params
        self.session: SessionInfo | None = None  # the child's session, once loaded
        self._emit: Emit | None = None
        self._send_lock = threading.Lock()
        self._turn = 0  # the latest answer asked for
        self._pending: tuple[str, int] | None = None  # ("answer", turn) or ("replan", 0) not ended yet
        self._state_lock = threading.Lock()  # _pending and _dead change together
        self._dead: str | None = None  # why the child is gone (one line), once it is
        self._closing = False
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self.process = context.Process(target=child_main, args=(child_conn, opener, params),
                                       name="localctx-chat-model", daemon=True)
        self.process.start()
        child_conn.close()
        self._send(("load",))

    # -- asked by the screen (UI thread or its worker threads) ----------------------------------
    def load(self, load: object, emit: Emit) -> None:
        """Starts handing the child's results to ``emit`` (the first: the model loaded, or why not).
        ``load`` is the in-process loader, not used: the child loads from its Opener."""
        self._emit = emit
        threading.Thread(target=self._read, name="chat-worker-results", daemon=True).start()

    def new_cancel(self) -> None:
        """The child keeps the cancel event; stop() reaches it by turn."""
        return None

    def answer(self, turn: int, messages: list[dict], cancel: object, emit: Emit) -> None:
        self._turn = turn
        if self._start(("answer", turn)):
            self._send(("answer", turn, messages))  # if the child is gone, the reader thread says so
        else:
            emit(Failed(turn, self._dead))

    def stop(self) -> None:
        if self._turn:
            self._send(("stop", self._turn))

    def reset(self) -> None:
        self._send(("reset",))

    def replan(self, kv: str | None, emit: Emit) -> None:
        if self._start(("replan", 0)):
            self._send(("replan", kv))
        else:
            emit(Replanned(None, self._dead))

    def close(self) -> None:
        """Stops any answer, lets the child release the model, and ends it if it does not exit."""
        if self._closing:
            return
        self._closing = True
        self._send(("close",))
        self.process.join(CLOSE_WAIT_S)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(2.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._conn.close()

    # -- internals ------------------------------------------------------------------------------
    def _start(self, pending: tuple[str, int]) -> bool:
        """Marks a request as waiting for its result; False when the child is already gone."""
        with self._state_lock:
            if self._dead is not None:
                return False
            self._pending = pending
            return True

    def _ended(self, pending: tuple[str, int]) -> None:
        with self._state_lock:
            if self._pending == pending:
                self._pending = None

    def _send(self, command: tuple) -> bool:
        if self._dead is not None:
            return False
        with self._send_lock:
            try:
                self._conn.send(command)
                return True
            except (OSError, EOFError, ValueError):
                return False  # the child is gone: the reader thread reports it

    def _read(self) -> None:
        while True:
            try:
                payload = self._conn.recv()
            except (OSError, EOFError, ValueError):
                break
            if isinstance(payload, StreamBatch):
                if payload.allocation is not None and self.session is not None:
                    self.session.plan.grow_to(*payload.allocation)  # before the events: the panel draws them
                for event in payload.events:
                    if event.kind == "done":
                        self._ended(("answer", payload.turn))
                    self._emit(Streamed(payload.turn, event))
                continue
            if isinstance(payload, Loaded | Replanned) and payload.session is not None:
                self.session = payload.session
            if isinstance(payload, Replanned):
                self._ended(("replan", 0))
            elif isinstance(payload, Failed):
                self._ended(("answer", payload.turn))
            self._emit(payload)
        if not self._closing:
            self._died()

    def _died(self) -> None:
        self.process.join(1.0)
        code = self.process.exitcode
        how = f"exit code {code}" if code is not None and code >= 0 else \
            f"signal {-code}" if code is not None else "still running, its pipe closed"
        dead = f"the model's process stopped ({how}); restart localctx chat to load it again"
        with self._state_lock:
            self._dead, pending, self._pending = dead, self._pending, None
        if self.session is None:
            self._emit(Loaded(None, RuntimeFailure(dead)))
        elif pending is not None and pending[0] == "answer":
            self._emit(Failed(pending[1], dead))
        elif pending is not None:
            self._emit(Replanned(None, dead))
        else:
            self._emit(Notice(dead))
