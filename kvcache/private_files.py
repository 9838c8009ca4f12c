"""Files localctx keeps for the user alone: its caches (prompt caches, calibrations, GGUF headers,
the llama.cpp probe, the bandwidth measurement), the compiled CPU kernel, and the chat history.

- Folders it creates are 0700, and a folder of its own it writes into is tightened to 0700.
- Files are written 0600, atomically: a temporary file created 0600 in the same folder (never
  wider, whatever the umask), flushed and fsynced, then renamed into place.
- A file is used only if it is trusted: a regular file (not a link) owned by this user, not
  writable by group or others, in a folder owned by this user (or root) that others cannot write
  either. A cache file or compiled kernel that is not is never loaded: the caller rebuilds it
  or goes without, and says why where it matters.

On systems without POSIX owners (Windows) the checks pass and the modes are left to the OS."""
from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path
from typing import IO, Iterator

POSIX = os.name == "posix"
DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: Path) -> Path:
    """``path`` and any missing parents, created 0700; ``path`` itself tightened to 0700 if it is this
    user's and wider. Returns ``path``."""
    path = Path(path)
    missing = []
    for folder in (path, *path.parents):
        if folder.exists():
            break
        missing.append(folder)
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    if POSIX:
        for folder in [*missing, path]:
            with contextlib.suppress(OSError):
                st = folder.stat()
                if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & 0o077:
                    os.chmod(folder, DIR_MODE)
    return path


@contextlib.contextmanager
def private_writer(path: Path) -> Iterator[IO[bytes]]:
    """A binary file to write ``path``'s new content into: created 0600 beside it, renamed into place
    when the block ends without an exception (removed otherwise)."""
    path = Path(path)
    private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), FILE_MODE)
    try:
        if POSIX:
            os.fchmod(fd, FILE_MODE)  # a stale temporary file of this name may have had another mode
        with os.fdopen(fd, "wb") as f:
            fd = -1
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_private(path: Path, data: bytes | str) -> None:
    """``data`` into ``path``, atomically, 0600."""
    with private_writer(path) as f:
        f.write(data.encode() if isinstance(data, str) else data)


def untrusted(path: Path) -> str | None:
    """Why ``path`` must not be used (a few words), or None when it may be. A missing file is None:
    the caller's own read says it is missing."""
    if not POSIX:
        return None
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"it cannot be checked ({exc.strerror or exc})"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    why = _loose(st, "it")
    if why:
        return why
    try:
        folder = os.stat(path.parent)
    except OSError as exc:
        return f"its folder cannot be checked ({exc.strerror or exc})"
    return _loose(folder, "its folder", root_ok=True)


def _loose(st: os.stat_result, what: str, root_ok: bool = False) -> str | None:
    uid = os.getuid()
    if st.st_uid != uid and not (root_ok and st.st_uid == 0):
        return f"{what} belongs to another user (uid {st.st_uid}, not {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'}"
    return None


def read_trusted(path: Path) -> bytes | None:
    """``path``'s bytes if it exists and is trusted, else None."""
    if untrusted(path) is not None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError:
        return None
