"""The client of an ``shm://NAME`` store: ``ShmStore``, the KVStore engines use.

The values live in a data segment under /dev/shm that every client maps; a
small index server (``server``, one per NAME, started on demand and detached
so it outlives the process that started it) owns the LRU index and hands out
chunks of the segment.  This module owns the client's side: it parses the
URL, starts a server where the URL and the open mode allow it, packs
requests, copies values between the caller's buffers and the segment (once,
with no intermediate buffer), and checks the chunk generations after each
read so that a value overwritten or evicted during the copy is a miss, never
a wrong value.  It must not keep the index or decide evictions (the
server's), nor define the wire format (``protocol``) or the file layout
(``paths``); it maps only the segments the protocol names.

Opened with ``OpenMode.INSPECT`` (for operators), it never starts a server,
also not after the server died: with none running, opening raises
``ShmServerNotRunning`` (a ``StoreOpenError``); its ``server`` option is then
ignored.

URL: ``shm://NAME?capacity=1GiB&chunk=64KiB&server=embedded&timeout=5``

* ``capacity`` (default 1GiB), ``chunk`` (default 64KiB): the size of the data
  segment and of its allocation unit.  They apply when this client starts the
  server; a running server keeps its own (``stats()`` reports them).
* ``server``: ``embedded`` (default) starts a server when none is running,
  also again after the server died (its data is then gone: misses);
  ``connect`` only uses a running one.
* ``idle_timeout``: the server exits after that long without requests
  (default: never, so a restarted engine still finds its blocks).
* ``lease_timeout`` (default 10m): when chunks taken by a live writer that
  never committed them are reclaimed.  Those of a dead writer are reclaimed
  within a second.
* ``timeout`` (default 5s): the longest an operation waits for the server,
  in all: reconnecting, starting a new server and its requests together (the
  copies of a put are not waiting, and do not count).  A server that died is
  noticed within about 50 ms.  Opening the store waits ``timeout`` for an
  answer, and as long as reserving the memory takes for a server it starts.
* ``overwrite`` (default false): a put of a key that is already stored keeps
  the stored value (keys are content addresses, so it is the same value) and
  skips the copy; ``true`` replaces it.
* ``prefault`` (default true): reserve the memory when the server starts and
  map it up front in each client, so that no copy pays page faults and no
  client can hit SIGBUS on a full /dev/shm.
* ``runtime_dir``: where the control socket and lock files go.  It must be
  this user's and writable by no one else (``paths.check_rundir``).
"""

from __future__ import annotations

import array
import errno
import itertools
import json
import math
import mmap
import os
import stat
import subprocess
import sys
import threading
import time
from typing import Iterator, Sequence

import numpy as np
import zmq

from ..base import (Buffer, KVStore, OpenMode, StoreError, StoreOpenError, StoreStats, StoreUnavailableError,
                    byte_view)
from ..urls import mask_password, parse_bool, parse_seconds, parse_size, query_options, split_url
from . import admin
from .paths import Paths, ShmServerNotRunning, UnsafeRuntimeDir, lock_until, name_arg, valid_name
from .protocol import (DEFAULT_CHUNK_NBYTES, DEFAULT_LEASE_TIMEOUT_S, EXIT_ALREADY_RUNNING, PROTOCOL_VERSION,
                       REPLY, REQUEST, Alloc, Flag, Op, Status, pack_keys, unpack_keys)

_OPTIONS = {"capacity", "chunk", "server", "idle_timeout", "lease_timeout", "timeout", "overwrite",
            "prefault", "runtime_dir"}
_POLL_SLICE_MS = 50
_START_TIMEOUT_S = 60.0
# Plain ints for the per-key loops of put (an enum member compares slower).
_ALLOC_NEW = int(Alloc.NEW)
_ALLOC_PRESENT = int(Alloc.PRESENT)
_ALLOC_FAILED = int(Alloc.FAILED)


def _copy(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src``, letting other threads run meanwhile: numpy drops the
    GIL for a large copy, a memoryview assignment does not (a caller may read
    the next blocks on one thread while it copies the last ones on another)."""
    if src.nbytes >= 65536:
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
    else:
        dst[:] = src

class _NoAnswer(Exception):
    pass


class _BadServer(Exception):
    """The server's HELLO names segments a client must not map."""


def _map_segment(named: object, expected: str, nbytes: int, *, writable: bool, populate: bool,
                 server_pid: int, name_arg: str) -> mmap.mmap:
    """Map the segment file ``expected``, which the server's HELLO must name.

    The client maps what the server names read-write and copies values into
    it, so a server that could name any file could make a put overwrite it.
    Only the path the protocol defines for this NAME and epoch is accepted,
    never through a symlink (/dev/shm is world-writable, so anyone can plant
    one under that name), and only a regular file of this user at least as
    large as announced (mmap would refuse a shorter one with a bare
    ValueError)."""
    if named != expected:
        raise _BadServer(f"the shm server (pid {server_pid}) named the segment {named!r}, not {expected!r}"
                         f" as the protocol defines; refusing to map it. Stop that server (`ucm shm stop {name_arg}`)"
                         f" and check what runs as it")
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(expected, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _BadServer(f"the shm segment {expected} is a symlink; refusing to map it. Remove it and stop "
                             f"the server (`ucm shm stop {name_arg}`)") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise _BadServer(f"the shm segment {expected} is not a regular file of uid {os.geteuid()} (owner uid "
                             f"{info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o}); refusing to map it. Remove "
                             f"it and stop the server (`ucm shm stop {name_arg}`)")
        if info.st_size < nbytes:
            raise _BadServer(f"the shm segment {expected} holds {info.st_size} bytes, fewer than the {nbytes} "
                             f"the shm server (pid {server_pid}) announced; refusing to map it. Stop the server "
                             f"(`ucm shm stop {name_arg}`)")
        mm_flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, nbytes, mm_flags, prot)
    finally:
        os.close(fd)


class _Segments:
    """The mapped segments of one server epoch.  Immutable: an operation
    keeps using the snapshot it started with, also if another thread remaps."""

    __slots__ = ("epoch", "server_pid", "chunk", "num_chunks", "data", "gen", "_maps")

    def __init__(self, info: dict, paths: Paths, populate: bool) -> None:
        try:
            self.epoch = int(info["epoch"])
            self.server_pid = int(info["pid"])
            self.chunk = int(info["chunk_nbytes"])
            self.num_chunks = int(info["num_chunks"])
        except (KeyError, TypeError, ValueError) as exc:
            raise _BadServer(f"the shm server's HELLO is malformed ({exc!r}); stop it "
                             f"(`ucm shm stop {name_arg(paths.name)}`)") from None
        if not (0 < self.epoch < 2**64 and self.chunk > 0 and 0 < self.num_chunks < 2**31):
            raise _BadServer(f"the shm server's HELLO is malformed (epoch {self.epoch}, chunk {self.chunk}, "
                             f"{self.num_chunks} chunks); stop it (`ucm shm stop {name_arg(paths.name)}`)")
        data_mm = _map_segment(info.get("data_path"), paths.segment(self.epoch, "data"),
                               self.chunk * self.num_chunks, writable=True, populate=populate,
                               server_pid=self.server_pid, name_arg=name_arg(paths.name))
        try:
            gen_mm = _map_segment(info.get("gen_path"), paths.segment(self.epoch, "gen"), self.num_chunks * 8,
                                  writable=False, populate=False, server_pid=self.server_pid,
                                  name_arg=name_arg(paths.name))
        except BaseException:
            data_mm.close()
            raise
        self._maps = (data_mm, gen_mm)
        self.data = memoryview(data_mm)
        self.gen = np.frombuffer(gen_mm, dtype=np.uint64)

    def release(self) -> None:
        self.data.release()
        self.gen = None
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:
                pass  # a view is still alive somewhere; the GC unmaps it later


class _ThreadSocket(threading.local):
    sock = None
    gen = -1
    pid = -1


class ShmStore(KVStore):
    """Client of one ``shm://NAME`` store.  Thread-safe: each thread talks to
    the server over its own socket; copies run in parallel."""

    def __init__(self, name: str, *, capacity_nbytes: int = 1 << 30,
                 chunk_nbytes: int = DEFAULT_CHUNK_NBYTES, server: str = "embedded",
                 idle_timeout_s: float | None = None, lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S,
                 timeout_s: float = 5.0, overwrite: bool = False, prefault: bool = True,
                 runtime_dir: str | None = None, url: str | None = None,
                 open_mode: OpenMode | str = OpenMode.SERVE) -> None:
        self.url = mask_password(url) if url else f"shm://{name}"
        self.open_mode = OpenMode(open_mode)
        if not isinstance(name, str) or not valid_name(name):
            raise StoreOpenError(
                f"store '{self.url}': the name {name!r} may hold only letters, digits, '-', '_' and '.' "
                f"(at most 80 characters)")
        if server not in ("embedded", "connect"):
            raise StoreOpenError(f"store '{self.url}': server={server!r} must be 'embedded' or 'connect'")
        if chunk_nbytes <= 0 or chunk_nbytes % 64:
            raise StoreOpenError(f"store '{self.url}': chunk={chunk_nbytes} must be a positive multiple of 64 bytes")
        if capacity_nbytes < chunk_nbytes:
            raise StoreOpenError(
                f"store '{self.url}': capacity={capacity_nbytes} is smaller than one chunk ({chunk_nbytes} bytes)")
        if timeout_s <= 0:
            raise StoreOpenError(f"store '{self.url}': timeout must be positive")
        self.name = name
        self._name_arg = name_arg(name)  # as shown in commands to run
        self.capacity_nbytes = capacity_nbytes
        self.chunk_nbytes = chunk_nbytes
        self.mode = server
        # Whether this client starts a server when none runs (on open and
        # after the server died): never when inspecting.
        self._starts_server = server == "embedded" and self.open_mode is OpenMode.SERVE
        self.idle_timeout_s = idle_timeout_s
        self.lease_timeout_s = lease_timeout_s
        self.timeout_s = timeout_s
        self.overwrite = overwrite
        self.prefault = prefault
        self.paths = Paths(name, os.path.abspath(runtime_dir) if runtime_dir else None)
        if len(self.paths.socket.encode()) > 100:
            raise StoreOpenError(
                f"store '{self.url}': the control socket path {self.paths.socket!r} is too long for a "
                f"unix socket; use a shorter name or runtime_dir")
        # _lock guards this object's state and is only ever held briefly;
        # _connect_lock makes one thread at a time (re)connect, which waits
        # on the server, so that other threads can wait for it with a timeout.
        self._lock = threading.RLock()
        self._connect_lock = threading.Lock()
        self._tls = _ThreadSocket()
        self._sockets: set = set()
        self._sock_gen = 0
        self._rids = itertools.count(1)
        self._pid = os.getpid()
        self._ctx = zmq.Context()
        self._seg: _Segments | None = None
        self._old_segs: list[_Segments] = []
        self._late_misses = 0
        self._torn_reads = 0
        self._closed = False
        try:
            self._connect()
        except StoreOpenError:
            self.close()
            raise
        except (StoreUnavailableError, OSError) as exc:
            self.close()
            raise StoreOpenError(f"store '{self.url}': {exc}") from exc

    @classmethod
    def from_url(cls, url: str, mode: OpenMode | str = OpenMode.SERVE) -> "ShmStore":
        """Open the store an ``shm://`` URL names.  ``mode``: ``OpenMode.SERVE``
        starts a server as the URL's ``server`` option says; ``INSPECT`` never
        does, and raises ``ShmServerNotRunning`` when none runs."""
        masked = mask_password(url)
        parts = split_url(url)
        if parts.scheme.lower() != "shm":
            raise StoreOpenError(f"store '{masked}' is not an shm:// URL")
        if "@" in parts.netloc:
            raise StoreOpenError(f"store '{masked}': an shm:// URL takes no user name or password; write it as "
                                 f"shm://NAME?capacity=4GiB")
        name = parts.netloc
        if parts.path not in ("", "/") or not name:
            raise StoreOpenError(f"store '{masked}': write it as shm://NAME?capacity=4GiB (NAME: letters, "
                                 f"digits, '-', '_', '.')")
        opts = query_options(url, _OPTIONS)
        kwargs: dict[str, object] = {}
        if "capacity" in opts:
            kwargs["capacity_nbytes"] = parse_size(opts["capacity"], url=url, name="capacity")
        if "chunk" in opts:
            kwargs["chunk_nbytes"] = parse_size(opts["chunk"], url=url, name="chunk")
        if "server" in opts:
            kwargs["server"] = opts["server"].strip().lower()
        if "idle_timeout" in opts:
            kwargs["idle_timeout_s"] = parse_seconds(opts["idle_timeout"], url=url, name="idle_timeout")
        if "lease_timeout" in opts:
            kwargs["lease_timeout_s"] = parse_seconds(opts["lease_timeout"], url=url, name="lease_timeout")
        if "timeout" in opts:
            kwargs["timeout_s"] = parse_seconds(opts["timeout"], url=url, name="timeout")
        if "overwrite" in opts:
            kwargs["overwrite"] = parse_bool(opts["overwrite"], url=url, name="overwrite")
        if "prefault" in opts:
            kwargs["prefault"] = parse_bool(opts["prefault"], url=url, name="prefault")
        if "runtime_dir" in opts:
            kwargs["runtime_dir"] = opts["runtime_dir"]
        return cls(name, url=url, open_mode=mode, **kwargs)  # type: ignore[arg-type]

    # ------------------------------------------------------------ transport

    def _socket(self):
        if self._closed:
            raise StoreUnavailableError(f"store '{self.url}' is closed")
        if os.getpid() != self._pid:
            self._after_fork()
        tls = self._tls
        sock = tls.sock
        if sock is None or tls.gen != self._sock_gen:
            with self._lock:
                if sock is not None and tls.pid == os.getpid():
                    self._sockets.discard(sock)
                    sock.close(0)
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RECONNECT_IVL, 10)
                sock.connect(self.paths.endpoint)
                self._sockets.add(sock)
                tls.sock = sock
                tls.gen = self._sock_gen
                tls.pid = os.getpid()
        return sock

    def _after_fork(self) -> None:
        # zmq contexts and sockets must not be used across fork; the mapped
        # segments are inherited and stay valid.
        with self._lock:
            if os.getpid() == self._pid:
                return
            self._pid = os.getpid()
            self._ctx = zmq.Context()
            self._sockets = set()
            self._sock_gen += 1
            # A thread of the parent may have been reconnecting at the fork.
            self._connect_lock = threading.Lock()

    def _call(self, op: int, frames: Sequence[bytes] = (), *, deadline: float, key_len: int = 0, flags: int = 0,
              arg: int = 0, epoch: int = 0) -> tuple[int, int, list[bytes]]:
        """One request and its answer, waiting until ``deadline`` (monotonic
        seconds) at most: the deadline of the whole operation, so that its
        reconnect, its server start and its requests together stay within
        ``timeout``."""
        sock = self._socket()
        rid = next(self._rids) & 0xFFFFFFFF
        # copy=False: frames above zmq's copy threshold (a large key batch)
        # go out without an extra copy; small ones are copied anyway.
        sock.send_multipart([REQUEST.pack(op, flags, key_len, rid, epoch, arg), *frames], copy=False)
        while True:
            slice_ms = min(_POLL_SLICE_MS, max(0, math.ceil((deadline - time.monotonic()) * 1000)))
            if sock.poll(slice_ms):
                reply = sock.recv_multipart()
                status, reply_rid, reply_epoch = REPLY.unpack(reply[0])
                if reply_rid != rid:
                    continue  # the late answer to a request that timed out
                if status == Status.ERROR:
                    raise StoreError(f"store '{self.url}': the shm server rejected a request: "
                                     f"{reply[1].decode(errors='replace') if len(reply) > 1 else '?'}")
                return status, reply_epoch, reply[1:]
            if not self.paths.server_running():
                self._invalidate_sockets()
                raise _NoAnswer("the shm server is not running")
            if time.monotonic() >= deadline:
                self._invalidate_sockets()
                raise _NoAnswer(f"the shm server did not answer within the timeout ({self.timeout_s:g}s)")

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    def _invalidate_sockets(self) -> None:
        # A socket with a request in flight would hand its late answer to the
        # next request; start every thread on a fresh socket instead.
        with self._lock:
            self._sock_gen += 1
            self._seg_broken = True

    def _unavailable(self, exc: Exception) -> StoreUnavailableError:
        if self.paths.server_running():
            hint = f"; it is running but busy or stopped (`ucm shm status {self._name_arg}`)"
        elif self._starts_server:
            hint = "; the next call starts a new server (its contents are lost)"
        else:
            hint = f"; start one with `python -m store_backends.shm_server serve {self._name_arg}`"
        return StoreUnavailableError(f"store '{self.url}' unavailable: {exc}{hint}")

    # ------------------------------------------------------------ connecting

    _seg_broken = False

    def _hello(self, deadline: float) -> dict | None:
        """The server's description of itself; None when no server runs.
        Raises ``_NoAnswer`` when one runs but does not answer: starting
        another would not help (it would find the PID lock held)."""
        if not self.paths.server_running():
            return None
        try:
            status, _epoch, frames = self._call(Op.HELLO, deadline=deadline)
        except _NoAnswer:
            if self.paths.server_running():
                raise
            return None
        try:
            info = json.loads(frames[0])
        except (IndexError, ValueError):
            info = None
        if not isinstance(info, dict):
            raise _BadServer(f"the shm server's HELLO is malformed; stop it (`ucm shm stop {self._name_arg}`)")
        if info.get("protocol") != PROTOCOL_VERSION:
            raise StoreOpenError(f"store '{self.url}': the running shm server speaks protocol "
                                 f"{info.get('protocol')}, this client {PROTOCOL_VERSION}; stop it first")
        return info

    def _not_running(self, opening: bool) -> StoreError:
        if self.open_mode is OpenMode.INSPECT:
            msg = (f"no shm server is running for {self.name!r}, so nothing is stored there (an shm store "
                   f"lives as long as its server); `ucm shm list` shows the running ones")
        else:
            msg = (f"no shm server is running for {self.name!r} (server=connect); start one with `python -m "
                   f"store_backends.shm_server serve {self._name_arg}` or use server=embedded")
        if not opening:
            return StoreUnavailableError(f"store '{self.url}' unavailable: {msg}")
        return ShmServerNotRunning(f"store '{self.url}': {msg}", name=self.name, runtime_dir=self.paths.rundir,
                                   starts_one=self.mode == "embedded")

    def _refusal(self, msg: str, opening: bool) -> StoreError:
        if opening:
            return StoreOpenError(f"store '{self.url}': {msg}")
        return StoreUnavailableError(f"store '{self.url}' unavailable: {msg}")

    def _connect(self, deadline: float | None = None) -> _Segments:
        """Say HELLO (starting a server first when none runs and the mode is
        embedded) and map the server's segments if they are new.  Within the
        operation's ``deadline``; ``None`` when opening the store, where each
        wait gets ``timeout`` and starting a server the time reserving its
        memory takes."""
        opening = deadline is None
        if opening:
            self._connect_lock.acquire()
        elif not self._connect_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise self._unavailable(_NoAnswer(f"another thread's reconnect to the shm server did not finish "
                                              f"within the timeout ({self.timeout_s:g}s)"))
        try:
            if self._seg is not None and not self._seg_broken:
                return self._seg  # another thread reconnected meanwhile
            return self._reconnect(deadline)
        finally:
            self._connect_lock.release()

    def _reconnect(self, deadline: float | None) -> _Segments:
        opening = deadline is None
        try:
            # On every (re)connect, never per operation: one stat.
            self.paths.check_rundir()
        except UnsafeRuntimeDir as exc:
            raise self._refusal(str(exc), opening) from None
        self._new_sockets()
        try:
            info = self._hello(deadline or self._deadline())
            if info is None:
                if not self._starts_server:
                    raise self._not_running(opening)
                self._start_server(deadline)
                self._new_sockets()
                info = self._hello(deadline or self._deadline())
                if info is None:
                    raise self._refusal(f"the shm server started but does not answer; see {self.paths.log}",
                                        opening)
        except _NoAnswer as exc:
            raise self._refusal(f"the shm server of {self.name!r} is running but does not answer ({exc}): it "
                                f"is busy or stopped; `ucm shm status {self._name_arg}` tells, `ucm shm "
                                f"stop {self._name_arg}` ends it", opening) from None
        except _BadServer as exc:
            raise self._refusal(str(exc), opening) from None
        seg = self._seg
        new = None
        if seg is None or seg.epoch != info.get("epoch"):
            try:
                new = _Segments(info, self.paths, populate=self.prefault)
            except FileNotFoundError as exc:
                raise StoreUnavailableError(
                    f"store '{self.url}' unavailable: the server's segment vanished ({exc})") from exc
            except _BadServer as exc:
                raise self._refusal(str(exc), opening) from None
        with self._lock:
            if self._closed:
                if new is not None:
                    new.release()
                raise StoreUnavailableError(f"store '{self.url}' is closed")
            if new is not None:
                if seg is not None:
                    # Other threads may still be copying from it; the GC
                    # unmaps it once they are done.
                    self._old_segs = [s for s in self._old_segs[-3:]] + [seg]
                self._seg = new
            self._seg_broken = False
            return self._seg

    def _new_sockets(self) -> None:
        with self._lock:
            self._sock_gen += 1

    def _start_server(self, deadline: float | None) -> None:
        """Start a detached server and wait until it is ready, or until the
        operation's ``deadline``; when opening (``None``), as long as
        reserving the memory may take.  A server still starting when the
        deadline passes goes on starting, and a later call finds it."""
        if not self._starts_server:  # the one guard: an inspecting client starts nothing
            raise self._not_running(deadline is None)
        try:
            self.paths.ensure_rundir()
        except UnsafeRuntimeDir as exc:
            raise StoreOpenError(f"store '{self.url}': {exc}") from None
        if deadline is None:
            # Reserving the memory takes about a second per GiB on a slow host.
            deadline = time.monotonic() + _START_TIMEOUT_S + 5.0 * self.capacity_nbytes / (1 << 30)
        fd = os.open(self.paths.start_lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if not lock_until(fd, deadline):
                raise StoreUnavailableError(
                    f"store '{self.url}' unavailable: another process is starting the shm server "
                    f"and has not finished in time ({self.paths.start_lock})")
            if self.paths.server_running():
                return  # started by whoever held the lock before us
            cmd = [sys.executable, "-m", "store_backends.shm_server", "serve",
                   "--capacity", str(self.capacity_nbytes), "--chunk", str(self.chunk_nbytes),
                   "--lease-timeout", repr(float(self.lease_timeout_s)),
                   "--runtime-dir", self.paths.rundir, "--detach"]
            if self.idle_timeout_s is not None:
                cmd += ["--idle-timeout", repr(float(self.idle_timeout_s))]
            if not self.prefault:
                cmd.append("--no-prefault")
            # After "--": a NAME may start with '-' and must not read as an option.
            cmd += ["--", self.name]
            env = dict(os.environ)
            # The directory holding the store_backends package.
            package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
            wait_s = max(0.001, deadline - time.monotonic())
            try:
                done = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, start_new_session=True, env=env, cwd="/",
                                      timeout=wait_s)
            except subprocess.TimeoutExpired as exc:
                raise StoreUnavailableError(f"store '{self.url}' unavailable: the shm server did not get "
                                            f"ready within {wait_s:.1f}s; see {self.paths.log}") from exc
            if done.returncode not in (0, EXIT_ALREADY_RUNNING):
                detail = done.stderr.decode(errors="replace").strip() or f"exit status {done.returncode}"
                raise StoreOpenError(f"store '{self.url}': could not start the shm server: {detail}")
        finally:
            os.close(fd)  # releases the lock

    def _segments(self, deadline: float) -> _Segments:
        seg = self._seg
        if seg is None or self._seg_broken or self._closed:
            if self._closed:
                raise StoreUnavailableError(f"store '{self.url}' is closed")
            seg = self._connect(deadline)
        return seg

    def _request(self, op: int, frames: Sequence[bytes] = (), *, key_len: int = 0, flags: int = 0,
                 arg: int = 0, bound: bool = True, deadline: float | None = None
                 ) -> tuple[_Segments, int, list[bytes]]:
        """One request, within ``deadline`` (default: ``timeout`` from now)
        including any reconnect; for ops that name chunks (``bound``), the
        request carries the epoch of our mapping and is retried after a
        remap when the server is a newer one."""
        if deadline is None:
            deadline = self._deadline()
        for _attempt in range(3):
            seg = self._segments(deadline)
            try:
                status, epoch, out = self._call(op, frames, deadline=deadline, key_len=key_len, flags=flags,
                                                arg=arg, epoch=seg.epoch if bound else 0)
            except _NoAnswer as exc:
                raise self._unavailable(exc) from None
            if status == Status.STALE or (bound and epoch != seg.epoch):
                with self._lock:
                    self._seg_broken = True
                continue
            return seg, status, out
        raise StoreUnavailableError(f"store '{self.url}' unavailable: the shm server keeps restarting")

    # ------------------------------------------------------------ KVStore

    def put(self, keys: Sequence[bytes], values: Sequence[bytes | Buffer]) -> list[bool]:
        if len(values) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        if not keys:
            return []
        srcs = [byte_view(v, writable=False) for v in values]
        key_len, key_frames = pack_keys(keys)
        sizes = array.array("q", [s.nbytes for s in srcs])
        flags = int(Flag.OVERWRITE) if self.overwrite else 0
        # One deadline for the waits of both requests; the copy between them
        # is not waiting on the server, so it extends the deadline.
        deadline = self._deadline()
        try:
            seg, _status, out = self._request(Op.ALLOC, [*key_frames, sizes.tobytes()], key_len=key_len,
                                              flags=flags, arg=os.getpid(), deadline=deadline)
        except StoreUnavailableError:
            # put never raises into the hot path for a medium that is gone;
            # the next call reconnects (or restarts the server).
            return [False] * len(keys)
        lease_id = int.from_bytes(out[0], "little", signed=True)
        status = out[1]
        nruns = array.array("I", out[2])
        runs = array.array("i", out[3])
        data = seg.data
        chunk = seg.chunk
        result = [s == _ALLOC_PRESENT for s in status]
        if not lease_id:
            return result
        pos = 0
        copy_started = time.monotonic()
        try:
            for i, st in enumerate(status):
                if st != _ALLOC_NEW:
                    continue
                src = srcs[i]
                size = sizes[i]
                end = pos + 2 * nruns[i]
                if nruns[i] == 1:
                    off = runs[pos] * chunk
                    data[off:off + size] = src
                else:
                    done = 0
                    for j in range(pos, end, 2):
                        n = min(runs[j + 1] * chunk, size - done)
                        off = runs[j] * chunk
                        data[off:off + n] = src[done:done + n]
                        done += n
                pos = end
        except BaseException:
            try:
                self._call(Op.ABORT, arg=lease_id, epoch=seg.epoch,
                           deadline=deadline + time.monotonic() - copy_started)
            except (_NoAnswer, StoreError):
                pass  # the sweep reclaims the lease once this process is gone
            raise
        deadline += time.monotonic() - copy_started
        try:
            _seg, commit_status, _ = self._request(Op.COMMIT, arg=lease_id, deadline=deadline)
        except StoreUnavailableError:
            return [r for r in result]
        if commit_status == Status.OK:
            return [st != _ALLOC_FAILED for st in status]
        return result

    def _lookup(self, keys: Sequence[bytes], flags: int = 0):
        key_len, key_frames = pack_keys(keys)
        late = 0
        if not flags & Flag.NO_TOUCH:
            with self._lock:
                late, self._late_misses = self._late_misses, 0
        seg, _status, out = self._request(Op.GET, key_frames, key_len=key_len, arg=late, flags=flags)
        sizes = array.array("q", out[0])
        gens = np.frombuffer(out[1], dtype=np.uint64)
        firsts = np.frombuffer(out[2], dtype=np.int32)
        nruns = array.array("I", out[3])
        runs = array.array("i", out[4])
        return seg, sizes, gens, firsts, nruns, runs

    @staticmethod
    def _unchanged(seg: _Segments, gens: np.ndarray, firsts: np.ndarray) -> list[bool]:
        # A value's chunks are freed together, and freeing bumps every
        # chunk's generation, so the first chunk's generation tells whether
        # any chunk of the value was reused since the lookup.
        current = seg.gen[np.maximum(firsts, 0)]
        return ((current == gens) | (firsts < 0)).tolist()

    def _count_misses(self, late: int, torn: int) -> None:
        if late or torn:
            with self._lock:
                self._late_misses += late
                self._torn_reads += torn

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        if len(buffers) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        if not keys:
            return []
        dsts = [byte_view(b, writable=True) for b in buffers]
        seg, sizes, gens, firsts, nruns, runs = self._lookup(keys)
        data = seg.data
        chunk = seg.chunk
        copied = [False] * len(keys)
        late = 0
        pos = 0
        for i, size in enumerate(sizes):
            if size < 0:
                continue
            end = pos + 2 * nruns[i]
            dst = dsts[i]
            if dst.nbytes != size:
                late += 1
                pos = end
                continue
            if nruns[i] == 1:
                off = runs[pos] * chunk
                _copy(dst, data[off:off + size])
            else:
                done = 0
                for j in range(pos, end, 2):
                    n = min(runs[j + 1] * chunk, size - done)
                    off = runs[j] * chunk
                    _copy(dst[done:done + n], data[off:off + n])
                    done += n
            copied[i] = True
            pos = end
        result = [c and u for c, u in zip(copied, self._unchanged(seg, gens, firsts))]
        torn = copied.count(True) - result.count(True)
        self._count_misses(late + torn, torn)
        return result

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        seg, sizes, gens, firsts, nruns, runs = self._lookup(keys)
        data = seg.data
        chunk = seg.chunk
        values: list[bytes | None] = [None] * len(keys)
        pos = 0
        for i, size in enumerate(sizes):
            if size < 0:
                continue
            end = pos + 2 * nruns[i]
            if nruns[i] == 1:
                off = runs[pos] * chunk
                values[i] = bytes(data[off:off + size])
            elif nruns[i] == 0:
                values[i] = b""
            else:
                parts = []
                done = 0
                for j in range(pos, end, 2):
                    n = min(runs[j + 1] * chunk, size - done)
                    off = runs[j] * chunk
                    parts.append(data[off:off + n])
                    done += n
                values[i] = b"".join(parts)
            pos = end
        torn = 0
        for i, unchanged in enumerate(self._unchanged(seg, gens, firsts)):
            if not unchanged and values[i] is not None:
                values[i] = None
                torn += 1
        self._count_misses(torn, torn)
        return values

    def peek(self, keys: Sequence[bytes], nbytes: int | None = None) -> list[tuple[int, bytes] | None]:
        """Copies the first ``nbytes`` of each value with a lookup that is
        neither an LRU use nor a counted get; a value reused during the copy
        reads as ``None``, as in ``get``."""
        if not keys:
            return []
        if nbytes is not None and nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        seg, sizes, gens, firsts, nruns, runs = self._lookup(keys, flags=Flag.NO_TOUCH)
        data = seg.data
        chunk = seg.chunk
        out: list[tuple[int, bytes] | None] = [None] * len(keys)
        pos = 0
        for i, size in enumerate(sizes):
            if size < 0:
                continue
            end = pos + 2 * nruns[i]
            want = size if nbytes is None else min(nbytes, size)
            parts = []
            done = 0
            for j in range(pos, end, 2):
                if done >= want:
                    break
                n = min(runs[j + 1] * chunk, want - done)
                off = runs[j] * chunk
                parts.append(data[off:off + n])
                done += n
            out[i] = (size, b"".join(parts))
            pos = end
        for i, unchanged in enumerate(self._unchanged(seg, gens, firsts)):
            if not unchanged:
                out[i] = None
        return out

    def iter_keys(self, batch: int = 1000) -> Iterator[list[bytes]]:
        """A snapshot of the server's index, least recently used first."""
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        try:
            _seg, _status, out = self._request(Op.KEYS, bound=False)
        except StoreUnavailableError:
            raise
        except StoreError as exc:
            if "unknown op" not in str(exc):
                raise
            raise StoreError(
                f"store '{self.url}': the running shm server predates key listing; restart it to use "
                f"this (`ucm shm stop {self._name_arg}`; its blocks are dropped)") from None
        key_len = int.from_bytes(out[0], "little", signed=True)
        keys, _ = unpack_keys(key_len, out[1:])
        for start in range(0, len(keys), batch):
            yield keys[start:start + batch]

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        key_len, key_frames = pack_keys(keys)
        _seg, _status, out = self._request(Op.CONTAINS, key_frames, key_len=key_len, bound=False)
        return np.frombuffer(out[0], dtype=np.bool_).tolist()

    def prefix_len(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        key_len, key_frames = pack_keys(keys)
        _seg, _status, out = self._request(Op.PREFIX, key_frames, key_len=key_len, bound=False)
        return int.from_bytes(out[0], "little", signed=True)

    def delete(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        key_len, key_frames = pack_keys(keys)
        self._request(Op.DELETE, key_frames, key_len=key_len, bound=False)

    def clear(self) -> None:
        """Remove every block (for operators and tests)."""
        self._request(Op.CLEAR, bound=False)

    def stats(self) -> StoreStats:
        with self._lock:
            late, self._late_misses = self._late_misses, 0
            torn = self._torn_reads
        _seg, _status, out = self._request(Op.STATS, arg=late, bound=False)
        info = json.loads(out[0])
        extra = {k: info[k] for k in ("epoch", "pid", "chunk_nbytes", "num_chunks", "free_chunks",
                                      "leased_chunks", "used_chunks", "num_leases", "uptime_s",
                                      "leases_reclaimed", "idle_timeout_s", "lease_timeout_s") if k in info}
        extra["server_pid"] = extra.pop("pid", None)
        extra["torn_reads"] = torn
        extra["data_path"] = info.get("data_path")
        return StoreStats(
            url=self.url,
            kind="shm",
            num_blocks=info["num_blocks"],
            nbytes=info["nbytes"],
            capacity_nbytes=info["capacity_nbytes"],
            num_evictions=info.get("evictions", 0),
            num_puts=info.get("puts", 0),
            num_gets=info.get("gets", 0),
            num_hits=info.get("hits", 0),
            num_misses=info.get("misses", 0),
            num_put_failures=info.get("put_failures", 0),
            extra=extra,
        )

    def shutdown_server(self, timeout_s: float = 10.0) -> bool:
        """Stop the server of this NAME (its blocks are gone) and close this
        client.  True if a server was running."""
        try:
            stopped = admin.stop_server(self.name, self.paths.rundir, timeout_s=timeout_s)
        finally:
            self.close()
        return stopped

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sockets, self._sockets = self._sockets, set()
            segs = [s for s in (self._seg, *self._old_segs) if s is not None]
            self._seg = None
            self._old_segs = []
        if os.getpid() == self._pid:
            for sock in sockets:
                sock.close(0)
            self._ctx.destroy(linger=0)
        for seg in segs:
            seg.release()
