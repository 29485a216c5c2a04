"""Where the files of an ``shm://NAME`` store live, and whether a server holds them.

Owns the names on the file system (segments under /dev/shm, the control
socket and lock files in the runtime directory), the rule for a valid NAME,
the safety check of the runtime directory, the one liveness test (a live
server holds ``NAME.pid`` locked for its whole life), and taking one of the
lock files with a deadline (``lock_until``, for the server's PID lock and a
starter's start lock).  Must not talk to a server, map a segment, or start
a process.

Files, for a store NAME:

* ``/dev/shm/ucm-shm.NAME.EPOCH.data`` and ``.gen``: the segments.  EPOCH is
  new for every server start, so a client still mapping the segments of a
  dead server never reads or writes the segments of its successor.
* ``RUNDIR/NAME.sock``: the control socket (a unix stream socket; messages
  framed as ``transport`` says).
* ``RUNDIR/NAME.pid``: flock-held by the live server for its whole life, so
  "is a server running" never depends on a timeout or on a PID being reused.
* ``RUNDIR/NAME.start``: flock-held by whoever is starting a server, so two
  processes racing to start one end up with one.
* ``RUNDIR/NAME.log``: the server's stderr.

RUNDIR is ``$UCM_SHM_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/ucm-shm``, else
``/tmp/ucm-shm-UID``.  It must belong to the user the server and its clients
run as and be writable by no one else (``check_rundir``): whoever can create
``NAME.sock`` there can stand in for the server.
"""

from __future__ import annotations

import fcntl
import os
import re
import shlex
import stat
import time

from ..base import StoreError, StoreOpenError

SEGMENT_DIR = "/dev/shm"
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,80}$")
_LOCK_RETRY_S = 0.01


# ---------------------------------------------------------------- naming

def valid_name(name: str) -> bool:
    """Whether ``name`` can name an shm store: letters, digits, '-', '_' and
    '.', at most 80 characters, not only dots (so it never names a path
    outside the runtime directory)."""
    return isinstance(name, str) and bool(NAME_RE.match(name)) and name.strip(".") != ""


def name_arg(name: str) -> str:
    """NAME as the argument of a command line shown to the user: after
    ``--`` when it starts with '-', so that it does not read as an option."""
    return f"-- {name}" if name.startswith("-") else name


def runtime_dir(override: str | None = None) -> str:
    """The runtime directory: ``override``, else the environment's (see above)."""
    if override:
        return override
    env = os.environ.get("UCM_SHM_RUNTIME_DIR")
    if env:
        return env
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return os.path.join(xdg, "ucm-shm")
    return f"/tmp/ucm-shm-{os.getuid()}"


class UnsafeRuntimeDir(StoreError):
    """The runtime directory is one that another user could write in."""


class ShmServerNotRunning(StoreOpenError):
    """No server runs for an shm store that was opened without leave to
    start one (``OpenMode.INSPECT``, or ``server=connect``).  ``name`` and
    ``runtime_dir`` say which server; ``starts_one`` whether opening the same
    URL to serve (an engine) would start it."""

    def __init__(self, message: str, *, name: str, runtime_dir: str, starts_one: bool) -> None:
        super().__init__(message)
        self.name = name
        self.runtime_dir = runtime_dir
        self.starts_one = starts_one


def check_rundir(path: str) -> None:
    """Raise ``UnsafeRuntimeDir`` unless ``path`` is a directory of this
    process's user (effective uid) that group and others cannot write in.

    Whoever can create files there can bind a socket of their own as
    ``NAME.sock``, and a client trusts that socket's answers: which chunks to
    write, and (if the client did not check) which files to map.  A
    directory someone planted in /tmp before us, or one left world-writable,
    is therefore refused, also for root: root writes wherever a fake server
    points it.  A missing directory is fine; ``ensure_rundir`` creates it
    private.  A symlink is followed only if it belongs to us or to root,
    since its owner could point it elsewhere at any time.
    """
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    euid = os.geteuid()
    instead = ("or set UCM_SHM_RUNTIME_DIR (or runtime_dir= in the shm:// URL) to a directory of your own "
               "with mode 0700, the same for every process of the cache")
    if stat.S_ISLNK(info.st_mode):
        if info.st_uid not in (euid, 0):
            raise UnsafeRuntimeDir(
                f"the shm runtime directory {path} is a symlink that belongs to uid {info.st_uid}, "
                f"not to this process's uid {euid}, who could point it elsewhere; remove it, {instead}")
        info = os.stat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeRuntimeDir(f"the shm runtime directory {path} is not a directory; remove it, {instead}")
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid != euid:
        raise UnsafeRuntimeDir(
            f"the shm runtime directory {path} belongs to uid {info.st_uid} (mode {mode:04o})"
            f", not to this process's uid {euid}; its owner could plant a fake shm server there. "
            f"Remove it if it is stale (`rm -r {shlex.quote(path)}`), {instead}")
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeRuntimeDir(
            f"the shm runtime directory {path} (owner uid {info.st_uid}) has mode {mode:04o}"
            f": group or others can write in it and plant a fake shm server. "
            f"Make it private (`chmod 700 {shlex.quote(path)}`), {instead}")


class Paths:
    """Where the files of store NAME live."""

    def __init__(self, name: str, rundir: str | None = None) -> None:
        self.name = name
        self.rundir = runtime_dir(rundir)
        base = os.path.join(self.rundir, name)
        self.socket = base + ".sock"
        self.pid_lock = base + ".pid"
        self.start_lock = base + ".start"
        self.log = base + ".log"

    def check_rundir(self) -> None:
        check_rundir(self.rundir)

    def ensure_rundir(self) -> None:
        """Create the runtime directory (private) if missing, and refuse one
        that is not safe to use (``check_rundir``)."""
        os.makedirs(self.rundir, mode=0o700, exist_ok=True)
        check_rundir(self.rundir)

    def server_running(self) -> bool:
        """Whether a live server holds the PID lock of NAME.  Taking the lock
        shared for an instant is harmless: a starting server retries its own
        exclusive lock for a while."""
        try:
            fd = os.open(self.pid_lock, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        finally:
            os.close(fd)

    def server_pid(self) -> int | None:
        """The PID the live server wrote into its PID lock; None when no
        server holds it (or it has not written it yet)."""
        if not self.server_running():
            return None
        try:
            with open(self.pid_lock, "rb") as f:
                text = f.read(32)
            pid = int(text.strip() or b"0")
        except (OSError, ValueError):
            return None
        return pid if pid > 0 else None

    def segment(self, epoch: int, kind: str) -> str:
        return os.path.join(SEGMENT_DIR, f"ucm-shm.{self.name}.{epoch:016x}.{kind}")

    def leftover_segments(self) -> list[str]:
        """Segment files of any epoch of this NAME (exact name match)."""
        pattern = re.compile(r"^ucm-shm\." + re.escape(self.name) + r"\.[0-9a-f]{16}\.(data|gen|keys|where)$")
        try:
            names = os.listdir(SEGMENT_DIR)
        except OSError:
            return []
        return [os.path.join(SEGMENT_DIR, n) for n in names if pattern.match(n)]


def lock_until(fd: int, deadline: float) -> bool:
    """Take the exclusive flock of the open lock file ``fd``, retrying while
    another process holds it until ``deadline`` (monotonic seconds).  False
    when it is still held then; the caller closes ``fd`` either way when it
    is done (closing releases the lock).

    Polls rather than blocks: a blocking flock cannot be given a deadline,
    and both holders this waits on let go soon (a client probing liveness
    holds the PID lock shared for an instant; a starter holds the start lock
    until its server is ready)."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_LOCK_RETRY_S)
