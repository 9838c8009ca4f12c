"""Chat history in SQLite under the user data directory (``LOCALCTX_DATA_DIR`` overrides it).

A database that cannot be read is moved aside with a notice and a fresh one is started: history
is worth keeping, but never worth a crash. It is the user's alone: the folder 0700, the database
0600 (SQLite gives its journal the same mode), tightened if an older version left them wider; a
database that belongs to another user is refused (kvcache/private_files.py)."""
from __future__ import annotations

import json
import os
import sqlite3
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import platformdirs

from localctx.backends.base import GenerationStats
from localctx.kvcache.errors import RuntimeFailure
from localctx.kvcache.private_files import FILE_MODE, POSIX, private_dir, untrusted

DATA_DIR_ENV = "LOCALCTX_DATA_DIR"
DB_NAME = "history.db"
SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    system TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    stats TEXT
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""
TITLE_CHARS = 48


def data_dir() -> Path:
    override = os.environ.get(DATA_DIR_ENV)
    return Path(override).expanduser() if override else Path(platformdirs.user_data_dir("localctx"))


@dataclass(frozen=True)
class TurnStats:
    """What one answer cost, as the events reported it (kept with the message)."""
    backend: str
    policy: str
    finish_reason: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    kv_bytes: int = 0
    kv_tokens: int = 0
    evicted_tokens: int = 0
    tokens_per_step: float = 0.0  # prompt lookup: answer tokens per decode forward (0: it did not run)
    shifted_tokens: int = 0  # of cached_tokens, kept at moved positions (llama.cpp --cache-reuse: lossy)

    @classmethod
    def from_stats(cls, stats: GenerationStats, finish_reason: str) -> "TurnStats":
        return cls(backend=stats.backend, policy=stats.policy, finish_reason=finish_reason,
                   prompt_tokens=stats.prompt_tokens, cached_tokens=stats.cached_tokens,
                   generated_tokens=stats.generated_tokens, prefill_tok_s=stats.prefill_tok_s,
                   decode_tok_s=stats.decode_tok_s, kv_bytes=stats.kv_bytes, kv_tokens=stats.kv_tokens,
                   evicted_tokens=stats.evicted_tokens,
                   tokens_per_step=stats.tokens_per_step if stats.speculate == "ngram" else 0.0,
                   shifted_tokens=stats.shifted_tokens)


@dataclass
class ChatMessage:
    role: str  # "user" | "assistant"
    content: str
    stats: TurnStats | None = None  # assistant answers only
    id: int | None = None


@dataclass
class Conversation:
    title: str = "New chat"
    system: str = ""
    messages: list[ChatMessage] = field(default_factory=list)
    id: int | None = None  # None until the first message is saved

    def prompt(self) -> list[dict]:
        """The message list the model sees: the system prompt, then every turn."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": m.role, "content": m.content} for m in self.messages]


@dataclass(frozen=True)
class ConversationSummary:
    id: int
    title: str
    n_messages: int
    updated: float


def title_from(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_CHARS else line[:TITLE_CHARS - 1].rstrip() + "…"


class History:
    """All chats on this machine. Every call runs on the UI thread."""

    def __init__(self, conn: sqlite3.Connection, path: Path):
        self.conn = conn
        self.path = path

    @classmethod
    def open(cls, path: Path | None = None) -> tuple["History", str | None]:
        """(history, notice): the notice says when a corrupt database was moved aside."""
        path = path or data_dir() / DB_NAME
        try:
            private_dir(path.parent)
            _own(path)
        except OSError as exc:
            raise RuntimeFailure(f"cannot create the chat history folder {path.parent}: {exc.strerror}; "
                                 f"set {DATA_DIR_ENV} to a writable folder") from None
        try:
            return cls(_connect(path), path), None
        except sqlite3.DatabaseError as exc:
            reason = str(exc)
        moved = _move_aside(path)
        _own(path)  # the fresh database: 0600 too
        notice = (f"the chat history {path} could not be read ({reason}); it was moved to {moved.name} "
                  "and a new history was started")
        try:
            return cls(_connect(path), path), notice
        except sqlite3.DatabaseError as exc2:
            raise RuntimeFailure(f"cannot create the chat history {path}: {exc2}; set {DATA_DIR_ENV} "
                                 "to a writable folder") from None

    def close(self) -> None:
        self.conn.close()

    # -- reading ---------------------------------------------------------------
    def conversations(self) -> list[ConversationSummary]:
        rows = self.conn.execute(
            "SELECT c.id, c.title, COUNT(m.id), c.updated FROM conversations c "
            "LEFT JOIN messages m ON m.conversation_id = c.id GROUP BY c.id ORDER BY c.updated DESC, c.id DESC")
        return [ConversationSummary(*row) for row in rows]

    def load(self, conversation_id: int) -> Conversation:
        row = self.conn.execute("SELECT title, system FROM conversations WHERE id = ?",
                                (conversation_id,)).fetchone()
        if row is None:
            raise KeyError(conversation_id)
        messages = [ChatMessage(role=role, content=content, stats=_stats_from_json(stats), id=mid)
                    for mid, role, content, stats in self.conn.execute(
                        "SELECT id, role, content, stats FROM messages WHERE conversation_id = ? ORDER BY id",
                        (conversation_id,))]
        return Conversation(title=row[0], system=row[1], messages=messages, id=conversation_id)

    # -- writing ---------------------------------------------------------------
    def add_message(self, conv: Conversation, message: ChatMessage) -> None:
        """Saves ``message`` (already appended to ``conv``); creates the conversation on its first one."""
        with self._writing():
            now = time.time()
            if conv.id is None:
                if conv.title == Conversation.title and message.role == "user":
                    conv.title = title_from(message.content)
                cur = self.conn.execute("INSERT INTO conversations (title, system, created, updated) "
                                        "VALUES (?, ?, ?, ?)", (conv.title, conv.system, now, now))
                conv.id = cur.lastrowid
            stats = json.dumps(asdict(message.stats)) if message.stats else None
            cur = self.conn.execute("INSERT INTO messages (conversation_id, role, content, stats) "
                                    "VALUES (?, ?, ?, ?)", (conv.id, message.role, message.content, stats))
            message.id = cur.lastrowid
            self.conn.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conv.id))

    def remove_message(self, conv: Conversation, message: ChatMessage) -> None:
        """Takes back a message that got no answer (stopped before its first token, or refused)."""
        conv.messages[:] = [m for m in conv.messages if m is not message]
        if message.id is not None:
            with self._writing():
                self.conn.execute("DELETE FROM messages WHERE id = ?", (message.id,))
            message.id = None

    def set_system(self, conv: Conversation, system: str) -> None:
        conv.system = system
        if conv.id is not None:
            with self._writing():
                self.conn.execute("UPDATE conversations SET system = ? WHERE id = ?", (system, conv.id))

    def clear(self, conv: Conversation) -> None:
        conv.messages.clear()
        if conv.id is not None:
            with self._writing():
                self.conn.execute("DELETE FROM messages WHERE conversation_id = ?", (conv.id,))

    def delete(self, conversation_id: int) -> None:
        with self._writing():
            self.conn.execute("DELETE FROM messages WHERE conversation_id = ?", (conversation_id,))
            self.conn.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def _writing(self):
        return _Writing(self.conn, self.path)


class _Writing:
    """A transaction whose sqlite errors become one RuntimeFailure line."""

    def __init__(self, conn: sqlite3.Connection, path: Path):
        self.conn = conn
        self.path = path

    def __enter__(self) -> None:
        self.conn.execute("BEGIN")

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.conn.execute("COMMIT")
            return False
        if self.conn.in_transaction:
            self.conn.execute("ROLLBACK")
        if isinstance(exc, sqlite3.Error):
            raise RuntimeFailure(f"the chat history {self.path} could not be saved: {exc}") from None
        return False


def _own(path: Path) -> None:
    """Creates the database file 0600 if it is missing; tightens one of this user's that is wider;
    refuses one that belongs to another user."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE))
        return
    except FileExistsError:
        pass
    st = os.lstat(path)
    if POSIX and stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, FILE_MODE)  # this user's own database, left wider by an older version
    why = untrusted(path)
    if why is not None:
        raise RuntimeFailure(f"the chat history {path} is not safe to open: {why}; move it away, or set "
                             f"{DATA_DIR_ENV} to a folder of your own")


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        ok = conn.execute("PRAGMA quick_check").fetchone()
        if ok is None or ok[0] != "ok":
            raise sqlite3.DatabaseError(f"integrity check failed: {ok[0] if ok else 'no answer'}")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise sqlite3.DatabaseError(f"it was written by a newer localctx (schema {version})")
        conn.executescript(_SCHEMA)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute("SELECT id, title, system, created, updated FROM conversations LIMIT 1").fetchall()
        conn.execute("SELECT id, conversation_id, role, content, stats FROM messages LIMIT 1").fetchall()
    except sqlite3.DatabaseError:
        conn.close()
        raise
    return conn


def _move_aside(path: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
        n += 1
    path.replace(target)
    for suffix in ("-wal", "-shm", "-journal"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            side.replace(target.with_name(target.name + suffix))
    return target


def _stats_from_json(text: str | None) -> TurnStats | None:
    if not text:
        return None
    try:
        return TurnStats(**json.loads(text))
    except (TypeError, ValueError):
        return None  # stats written by another version: the message itself still loads
