"""Operating the shm servers of this user: which run, what each holds, stopping one.

Owns the public admin API that ``ucm shm list|status|stop`` and scripts use:
``list_servers``, ``server_running`` (is there an shm store of that NAME:
an shm store lives exactly as long as its server), ``server_status`` (a
``ServerStatus``), ``stop_server``, ``check_runtime_dir`` and ``valid_name``.
Must not start a server, map a segment, or read or write blocks: it sends
only the requests that do not depend on a mapping (STATS, SHUTDOWN).  The
store itself (``client.ShmStore``) is the way to the blocks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import time

from . import transport
from .paths import Paths, check_rundir, valid_name
from .paths import runtime_dir as _resolve_runtime_dir
from .protocol import REPLY, REQUEST, Op, Status

__all__ = ["ServerStatus", "check_runtime_dir", "list_servers", "server_running", "server_status",
           "stop_server", "valid_name"]


@dataclasses.dataclass(frozen=True)
class ServerStatus:
    """What the server of an shm store NAME says about itself.

    ``running``: a live server holds NAME's lock.  ``answering``: it also
    answered; only then are the figures set (else ``None``, and the counters
    0).  The figures are the server's own: sizes in bytes, chunk counts,
    counters since the server started (``gets``, ``hits``...), ``uptime_s``.
    ``log_path`` is the server's stderr and ``pid_path`` the file holding its
    PID, for the operator to look at when it does not answer or exit."""

    name: str
    runtime_dir: str
    running: bool = False
    answering: bool = False
    log_path: str = ""
    pid_path: str = ""
    protocol: int | None = None
    pid: int | None = None
    epoch: int | None = None
    uptime_s: float | None = None
    num_blocks: int | None = None
    nbytes: int | None = None
    capacity_nbytes: int | None = None
    chunk_nbytes: int | None = None
    num_chunks: int | None = None
    free_chunks: int | None = None
    leased_chunks: int | None = None
    used_chunks: int | None = None
    num_leases: int | None = None
    reserved_chunks: int | None = None       # of the leased ones: reserved for writers' next puts
    cpus: list[int] | None = None            # the server may run on these
    idle_timeout_s: float | None = None
    lease_timeout_s: float | None = None
    data_path: str | None = None
    gen_path: str | None = None
    keys_path: str | None = None
    key_table_slots: int | None = None
    key_table_live: int | None = None
    key_table_used: int | None = None
    key_table_active: bool | None = None
    where_path: str | None = None
    gets: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_failures: int = 0
    evictions: int = 0
    leases_reclaimed: int = 0

    @property
    def used_nbytes(self) -> int | None:
        """Bytes of the data segment in chunks that hold committed values."""
        if self.used_chunks is None or self.chunk_nbytes is None:
            return None
        return self.used_chunks * self.chunk_nbytes

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


# The figures a server reports that ServerStatus has a field for; a newer
# server's other figures are left out rather than guessed at.
_FIGURES = frozenset(f.name for f in dataclasses.fields(ServerStatus)) - {
    "name", "runtime_dir", "running", "answering", "log_path", "pid_path"}


def _paths(name: str, runtime_dir: str | None) -> Paths:
    if not valid_name(name):
        raise ValueError(f"{name!r} is not an shm store name: letters, digits, '-', '_' and '.', "
                         f"at most 80 characters")
    return Paths(name, runtime_dir)


def check_runtime_dir(runtime_dir: str | None = None) -> str:
    """The runtime directory of this user's shm servers (``runtime_dir`` when
    given, else the environment's: see ``paths``), once it is known to be safe
    to trust what answers there: raises ``UnsafeRuntimeDir`` for a directory
    another user owns or can write in.  A missing directory is fine (no
    server runs there)."""
    directory = _resolve_runtime_dir(runtime_dir)
    check_rundir(directory)
    return directory


def list_servers(runtime_dir: str | None = None) -> list[str]:
    """The NAMEs whose server runs in the runtime directory, sorted."""
    directory = _resolve_runtime_dir(runtime_dir)
    try:
        entries = sorted(os.listdir(directory))
    except OSError:
        return []
    names = [entry[:-len(".pid")] for entry in entries if entry.endswith(".pid")]
    return [name for name in names if valid_name(name) and Paths(name, directory).server_running()]


def server_running(name: str, runtime_dir: str | None = None) -> bool:
    """Whether the server of NAME runs, so that an ``shm://NAME`` store
    exists (like ``dbm.whichdb`` for a file).  Sends nothing; starts
    nothing."""
    return _paths(name, runtime_dir).server_running()


def _request(paths: Paths, op: Op, timeout_s: float) -> tuple[int, list[bytes]] | None:
    """One epoch-free request to the server of NAME; None if none answers.
    Raises ``UnsafeRuntimeDir`` rather than talk to a socket anyone could
    have put there."""
    if not paths.server_running() or not os.path.exists(paths.socket):
        return None
    paths.check_rundir()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)     # a stopped server's full accept queue fails the connect, never blocks it
    try:
        sock.connect(paths.socket)
        deadline = time.monotonic() + timeout_s
        if not transport.send(sock, [REQUEST.pack(op, 0, 0, 1, 0, 0)], deadline, lambda: True):
            return None
        reply = transport.receive(sock, deadline, lambda: True)
    except (OSError, transport.PeerGone):
        return None
    finally:
        sock.close()
    if reply is None:
        return None
    status, _rid, _epoch = REPLY.unpack(reply[0])
    return status, [bytes(frame) for frame in reply[1:]]


def server_status(name: str, runtime_dir: str | None = None, timeout_s: float = 2.0) -> ServerStatus:
    """What the server of NAME says about itself, waiting ``timeout_s`` for
    it at most.  A server that does not run, or does not answer, is a
    ``ServerStatus`` with ``answering`` false (and ``running`` telling
    which)."""
    paths = _paths(name, runtime_dir)
    answer = _request(paths, Op.STATS, timeout_s)
    base = dict(name=name, runtime_dir=paths.rundir, log_path=paths.log, pid_path=paths.pid_lock)
    info = None
    if answer is not None and answer[0] == Status.OK and answer[1]:
        try:
            info = json.loads(answer[1][0])
        except ValueError:
            info = None
    if not isinstance(info, dict):
        return ServerStatus(**base, running=paths.server_running())
    figures = {key: value for key, value in info.items() if key in _FIGURES}
    return ServerStatus(**base, running=True, answering=True, **figures)


def stop_server(name: str, runtime_dir: str | None = None, timeout_s: float = 10.0) -> bool:
    """Ask NAME's server to exit and wait until it has removed its files
    (its blocks are gone).  True if a server was running.  Raises
    ``TimeoutError`` when it has not exited within ``timeout_s`` (the request
    and the exit together)."""
    paths = _paths(name, runtime_dir)
    if not paths.server_running():
        return False
    deadline = time.monotonic() + timeout_s
    if _request(paths, Op.SHUTDOWN, timeout_s=min(timeout_s, 2.0)) is None:
        # No answer: a busy server, or one of an older version that speaks
        # another protocol.  SIGTERM makes any of them exit cleanly.
        pid = paths.server_pid()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
    while paths.server_running():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the shm server of {name!r} did not exit within {timeout_s:g}s")
        time.sleep(0.01)
    return True
