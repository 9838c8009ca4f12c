"""The chat's model side, run from worker threads: streams answers, stops them, re-plans.

Nothing here knows about Textual: results go to an ``emit`` callback (the screen posts them to
itself, which is thread-safe). One lock keeps generation, reset, re-plan and close from overlapping."""
from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass
from typing import Callable

from localctx.backends.base import GenerationEvent, GenerationParams, Session
from localctx.kvcache.errors import RuntimeFailure, UserError


@dataclass(frozen=True)
class Streamed:
    turn: int
    event: GenerationEvent


@dataclass(frozen=True)
class Failed:
    turn: int
    message: str  # one line for the user
    detail: str = ""  # traceback of an unexpected error, for the log


@dataclass(frozen=True)
class Loaded:
    """The model finished loading (session) or could not be loaded (error, a one-line UserError or
    RuntimeFailure that the command reports once the app has closed)."""
    session: Session | None
    error: Exception | None = None


@dataclass(frozen=True)
class Notice:
    """A line the session has for the user mid-answer (the prompt cache on disk ignored a file, could
    not write one): shown in the chat, never printed to stderr over the screen."""
    message: str


@dataclass(frozen=True)
class Replanned:
    session: Session | None  # None when the new policy was refused
    message: str


Emit = Callable[[object], None]
Reopen = Callable[[str | None], Session]  # a new session with this --kv policy (None = planned)
Load = Callable[[], Session]  # loads the planned model


def route_notices(session: Session, emit: Emit) -> None:
    """The session's prompt cache tells the chat, not stderr (which would draw over the screen)."""
    if session.prompt_cache is not None:
        session.prompt_cache.notice = lambda line: emit(Notice(line))


class ChatEngine:
    decodes_here = True  # the session runs in the UI's process (its threads share the UI's GIL)

    def __init__(self, reopen: Reopen, params: GenerationParams):
        self.session: Session | None = None  # until load() has run
        self.reopen = reopen
        self.params = params
        self._lock = threading.Lock()
        self._cancel: threading.Event | None = None

    # -- UI thread ---------------------------------------------------------------
    def new_cancel(self) -> threading.Event:
        self._cancel = threading.Event()
        return self._cancel

    def stop(self) -> None:
        """Asks the answer in progress to stop after its current token (what it generated is kept)."""
        if self._cancel is not None:
            self._cancel.set()

    def reset(self) -> None:
        """Forgets the cached conversation (a new chat, another chat, /clear)."""
        if self.session is None:
            return  # still loading (a model just loaded has nothing cached): do not wait for it
        with self._lock:
            self.session.reset()

    # -- worker threads ----------------------------------------------------------
    def load(self, load: Load, emit: Emit) -> None:
        """Loads the model while the UI is already up; answers wait for it (they take the same lock)."""
        with self._lock:
            try:
                self.session = load()
            except (UserError, RuntimeFailure) as exc:
                emit(Loaded(None, exc))
                return
            except Exception as exc:  # a backend bug: one line for the user, the traceback in the log
                emit(Loaded(None, RuntimeFailure(f"loading the model failed: {type(exc).__name__}: {exc}")))
                return
            route_notices(self.session, emit)
            emit(Loaded(self.session))

    def answer(self, turn: int, messages: list[dict], cancel: threading.Event, emit: Emit) -> None:
        """Streams the answer to ``messages``; the session reuses whatever prefix its cache holds."""
        with self._lock:
            try:
                for event in self.session.generate(messages, self.params, cancel):
                    emit(Streamed(turn, event))
            except UserError as exc:  # refused before anything ran (the cache is as it was)
                emit(Failed(turn, str(exc)))
            except RuntimeFailure as exc:
                emit(Failed(turn, f"{exc}{self._forget_cache()}"))
            except Exception as exc:  # a backend bug must not take the chat down with it
                emit(Failed(turn, f"generation failed: {type(exc).__name__}: {exc}{self._forget_cache()}",
                            traceback.format_exc()))

    def _forget_cache(self) -> str:
        """After a failure mid-answer: whatever the backend kept of the failed step, the next answer
        starts from an empty cache (it prefills the conversation again)."""
        try:
            self.session.reset()
        except Exception as exc:  # the session cannot even reset: say so, the next answer will fail too
            return f"; the session could not be reset ({type(exc).__name__}: {exc}): re-plan with /kv or restart"
        return "; the cached conversation was dropped, the next answer reads it again"

    def replan(self, kv: str | None, emit: Emit) -> None:
        """Opens a session with policy ``kv`` and swaps it in; the old one stays if that fails."""
        with self._lock:
            try:
                new = self.reopen(kv)
            except (UserError, RuntimeFailure) as exc:
                emit(Replanned(None, str(exc)))
                return
            except Exception as exc:
                emit(Replanned(None, f"re-planning failed: {type(exc).__name__}: {exc}"))
                return
            route_notices(new, emit)
            old, self.session = self.session, new
            if old is not None:
                old.close()
            emit(Replanned(new, f"KV policy is now {new.plan.policy} ({new.plan.kv_layout})"))

    def close(self) -> None:
        """Stops any answer, waits for it, and releases the model."""
        self.stop()
        with self._lock:
            if self.session is not None:
                self.session.close()
