"""A client's connection to the index server of an ``shm://NAME`` store.

Owns the client's way to its server: a unix socket per thread (fresh ones
after a fork or a request that went unanswered; messages framed as
``transport`` says), one request and its answer
within the deadline of the whole operation, saying HELLO, and reconnecting:
starting a server where the mode allows it (``launch``), mapping the
segments of a new server epoch (``segments``), and retrying a request that
named chunks of an epoch that is gone.  It also words the errors a user
sees when the server is missing, busy or refused.  Must not pack the
requests of the store's operations or copy values (``client``), keep the
index (``server``), or define the wire format (``protocol``).
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time
from typing import Sequence

from ..base import OpenMode, StoreError, StoreOpenError, StoreUnavailableError
from .launch import ServerSettings, start_server
from .paths import Paths, ShmServerNotRunning, UnsafeRuntimeDir, name_arg
from .protocol import NO_REPLY_OPS, PROTOCOL_VERSION, REPLY, REQUEST, Op, Status
from .segments import BadServer, Segments
from .transport import OLDER_SERVER, PeerGone, receive, send

_POLL_SLICE_S = 0.05
#: How often a request retries connecting to a server that holds its PID
#: lock but has not opened its socket yet (it is starting).
_CONNECT_RETRY_S = 0.005


class NoAnswer(Exception):
    """The server did not answer a request in time, or is gone."""


class _ThreadSocket(threading.local):
    sock = None
    gen = -1
    pid = -1


class ServerConnection:
    """The connection of one ``ShmStore`` to its server.  Thread-safe: each
    thread talks over its own socket; one thread at a time reconnects."""

    def __init__(self, url: str, paths: Paths, settings: ServerSettings, *, timeout_s: float,
                 open_mode: OpenMode, server_mode: str) -> None:
        self.url = url
        self.paths = paths
        self.settings = settings
        self.name = settings.name
        self.timeout_s = timeout_s
        self.open_mode = open_mode
        self._name_arg = name_arg(self.name)  # as shown in commands to run
        # server=embedded when opened to serve: start a server when none runs
        # (on open and after the server died); never when inspecting.
        self.server_mode = server_mode
        self.starts_server = server_mode == "embedded" and open_mode is OpenMode.SERVE
        # _lock guards this object's state and is only ever held briefly;
        # _connect_lock makes one thread at a time (re)connect, which waits
        # on the server, so that other threads can wait for it with a timeout.
        self._lock = threading.RLock()
        self._connect_lock = threading.Lock()
        self._tls = _ThreadSocket()
        self._sockets: set = set()
        self._sock_gen = 0
        self._rids = itertools.count(1)
        self.pid = os.getpid()  # the process whose sockets these are
        self._seg: Segments | None = None
        self._old_segs: list[Segments] = []
        self._seg_broken = False
        self._closed = False

    # ------------------------------------------------------------ transport

    def _socket(self) -> socket.socket:
        """This thread's socket, connected now if it is new (``OSError``
        when no server listens)."""
        if self._closed:
            raise StoreUnavailableError(f"store '{self.url}' is closed")
        if os.getpid() != self.pid:
            self._after_fork()
        tls = self._tls
        sock = tls.sock
        if sock is None or tls.gen != self._sock_gen:
            with self._lock:
                if sock is not None and tls.pid == os.getpid():
                    self._sockets.discard(sock)
                    sock.close()
                tls.sock = None
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                # Non-blocking before connecting: a stopped server's full
                # accept queue then fails the connect at once (the caller
                # retries within its deadline) instead of blocking it.
                sock.setblocking(False)
                try:
                    sock.connect(self.paths.socket)
                except OSError:
                    sock.close()
                    raise
                self._sockets.add(sock)
                tls.sock = sock
                tls.gen = self._sock_gen
                tls.pid = os.getpid()
        return sock

    def _drop_socket(self) -> None:
        """Close this thread's socket (it holds part of a message, or its
        server is gone); the next request opens a new one."""
        with self._lock:
            sock, self._tls.sock = self._tls.sock, None
            if sock is not None and self._tls.pid == os.getpid():
                self._sockets.discard(sock)
                sock.close()

    def _after_fork(self) -> None:
        # The parent's sockets must not carry the child's requests; the
        # mapped segments are inherited and stay valid.
        with self._lock:
            if os.getpid() == self.pid:
                return
            self.pid = os.getpid()
            self._sockets = set()
            self._sock_gen += 1
            # A thread of the parent may have been reconnecting at the fork.
            self._connect_lock = threading.Lock()

    def call(self, op: int, frames: Sequence[bytes] = (), *, deadline: float, key_len: int = 0, flags: int = 0,
             arg: int = 0, epoch: int = 0) -> tuple[int, int, list[bytes]]:
        """One request and its answer, waiting until ``deadline`` (monotonic
        seconds) at most: the deadline of the whole operation, so that its
        reconnect, its server start and its requests together stay within
        ``timeout``.  Raises ``NoAnswer`` when none comes.  For an op of
        ``NO_REPLY_OPS``, returns once it is sent, with status OK and no
        frames: the next request on this thread's socket is answered after
        the server read it."""
        rid = next(self._rids) & 0xFFFFFFFF
        message = [REQUEST.pack(op, flags, key_len, rid, epoch, arg), *frames]
        running = self.paths.server_running
        while True:
            try:
                sock = self._socket()
                break
            except OSError:
                # No server listens: gone, or still starting (it holds its
                # PID lock before it opens its socket).
                if not running() or time.monotonic() >= deadline:
                    raise self._no_answer() from None
                time.sleep(_CONNECT_RETRY_S)
        try:
            reply = None
            if send(sock, message, deadline, running, _POLL_SLICE_S):
                if op in NO_REPLY_OPS:
                    return Status.OK, epoch, []
                reply = receive(sock, deadline, running, _POLL_SLICE_S)
        except PeerGone as exc:
            self._drop_socket()
            if str(exc) == OLDER_SERVER:
                self._invalidate_sockets()
                raise NoAnswer(f"{exc}; stop it (`ucm shm stop {self._name_arg}`; its blocks are dropped)"
                               ) from None
            raise self._no_answer() from None
        except OSError:
            reply = None        # the server closed the connection: gone, or it refused what it got
        if reply is None:
            self._drop_socket()
            raise self._no_answer()
        status, reply_rid, reply_epoch = REPLY.unpack(reply[0])
        if reply_rid != rid:
            self._drop_socket()
            raise NoAnswer(f"the shm server answered request {reply_rid} to request {rid}")
        if status == Status.ERROR:
            raise StoreError(f"store '{self.url}': the shm server rejected a request: "
                             f"{bytes(reply[1]).decode(errors='replace') if len(reply) > 1 else '?'}")
        return status, reply_epoch, reply[1:]

    def _no_answer(self) -> NoAnswer:
        """After a request that got no answer: mark the mapping suspect, and
        say whether the server is gone or did not answer in time."""
        self._invalidate_sockets()
        if not self.paths.server_running():
            return NoAnswer("the shm server is not running")
        return NoAnswer(f"the shm server did not answer within the timeout ({self.timeout_s:g}s)")

    def deadline(self) -> float:
        """The deadline of an operation that starts now."""
        return time.monotonic() + self.timeout_s

    def _invalidate_sockets(self) -> None:
        # A socket with a request in flight would hand its late answer to the
        # next request; start every thread on a fresh socket instead.
        with self._lock:
            self._sock_gen += 1
            self._seg_broken = True

    def _new_sockets(self) -> None:
        with self._lock:
            self._sock_gen += 1

    # ------------------------------------------------------------ errors

    def _unavailable(self, exc: Exception) -> StoreUnavailableError:
        if self.paths.server_running():
            hint = f"; it is running but busy or stopped (`ucm shm status {self._name_arg}`)"
        elif self.starts_server:
            hint = "; the next call starts a new server (its contents are lost)"
        else:
            hint = f"; start one with `python -m store_backends.shm_server serve {self._name_arg}`"
        return StoreUnavailableError(f"store '{self.url}' unavailable: {exc}{hint}")

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
                                   starts_one=self.server_mode == "embedded")

    def _refusal(self, msg: str, opening: bool) -> StoreError:
        if opening:
            return StoreOpenError(f"store '{self.url}': {msg}")
        return StoreUnavailableError(f"store '{self.url}' unavailable: {msg}")

    # ------------------------------------------------------------ connecting

    def _hello(self, deadline: float) -> dict | None:
        """The server's description of itself; None when no server runs.
        Raises ``NoAnswer`` when one runs but does not answer: starting
        another would not help (it would find the PID lock held)."""
        if not self.paths.server_running():
            return None
        try:
            status, _epoch, frames = self.call(Op.HELLO, deadline=deadline)
        except NoAnswer:
            if self.paths.server_running():
                raise
            return None
        try:
            info = json.loads(frames[0])
        except (IndexError, ValueError):
            info = None
        if not isinstance(info, dict):
            raise BadServer(f"the shm server's HELLO is malformed; stop it (`ucm shm stop {self._name_arg}`)")
        if info.get("protocol") != PROTOCOL_VERSION:
            raise StoreOpenError(f"store '{self.url}': the running shm server speaks protocol "
                                 f"{info.get('protocol')}, this client {PROTOCOL_VERSION}; stop it first")
        return info

    def connect(self, deadline: float | None = None) -> Segments:
        """Say HELLO (starting a server first when none runs and the mode is
        embedded) and map the server's segments if they are new.  Within the
        operation's ``deadline``; ``None`` when opening the store, where each
        wait gets ``timeout`` and starting a server the time reserving its
        memory takes."""
        opening = deadline is None
        if opening:
            self._connect_lock.acquire()
        elif not self._connect_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise self._unavailable(NoAnswer(f"another thread's reconnect to the shm server did not finish "
                                             f"within the timeout ({self.timeout_s:g}s)"))
        try:
            if self._seg is not None and not self._seg_broken:
                return self._seg  # another thread reconnected meanwhile
            return self._reconnect(deadline)
        finally:
            self._connect_lock.release()

    def _reconnect(self, deadline: float | None) -> Segments:
        opening = deadline is None
        try:
            # On every (re)connect, never per operation: one stat.
            self.paths.check_rundir()
        except UnsafeRuntimeDir as exc:
            raise self._refusal(str(exc), opening) from None
        self._new_sockets()
        try:
            info = self._hello(deadline or self.deadline())
            if info is None:
                if not self.starts_server:
                    raise self._not_running(opening)
                self._start_server(deadline)
                self._new_sockets()
                info = self._hello(deadline or self.deadline())
                if info is None:
                    raise self._refusal(f"the shm server started but does not answer; see {self.paths.log}",
                                        opening)
        except NoAnswer as exc:
            raise self._refusal(f"the shm server of {self.name!r} is running but does not answer ({exc}): it "
                                f"is busy or stopped; `ucm shm status {self._name_arg}` tells, `ucm shm "
                                f"stop {self._name_arg}` ends it", opening) from None
        except BadServer as exc:
            raise self._refusal(str(exc), opening) from None
        seg = self._seg
        new = None
        if seg is None or seg.epoch != info.get("epoch"):
            try:
                new = Segments(info, self.paths, populate=self.settings.prefault)
            except FileNotFoundError as exc:
                raise StoreUnavailableError(
                    f"store '{self.url}' unavailable: the server's segment vanished ({exc})") from exc
            except BadServer as exc:
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

    def _start_server(self, deadline: float | None) -> None:
        if not self.starts_server:  # the one guard: an inspecting client starts nothing
            raise self._not_running(deadline is None)
        start_server(self.settings, self.paths, self.url, deadline)

    # ------------------------------------------------------------ requests

    def mapped(self) -> Segments | None:
        """The segments mapped now, if they are believed current (no request
        is made: a caller that finds none asks the server)."""
        seg = self._seg
        if seg is None or self._seg_broken or self._closed:
            return None
        return seg

    def _segments(self, deadline: float) -> Segments:
        seg = self._seg
        if seg is None or self._seg_broken or self._closed:
            if self._closed:
                raise StoreUnavailableError(f"store '{self.url}' is closed")
            seg = self.connect(deadline)
        return seg

    def request(self, op: int, frames: Sequence[bytes] = (), *, key_len: int = 0, flags: int = 0,
                arg: int = 0, bound: bool = True, deadline: float | None = None, epoch: int | None = None
                ) -> tuple[Segments, int, list[bytes]]:
        """One request, within ``deadline`` (default: ``timeout`` from now)
        including any reconnect; for ops that name chunks (``bound``), the
        request carries the epoch of our mapping and is retried after a
        remap when the server is a newer one.  A request that names a lease
        (or chunks) handed out in ``epoch`` is never retried under another:
        a newer server's lease of the same number is another writer's, so it
        raises ``StoreUnavailableError`` instead."""
        if deadline is None:
            deadline = self.deadline()
        if epoch is not None:
            return self._request_in(epoch, op, frames, key_len=key_len, flags=flags, arg=arg, deadline=deadline)
        for _attempt in range(3):
            seg = self._segments(deadline)
            try:
                status, epoch, out = self.call(op, frames, deadline=deadline, key_len=key_len, flags=flags,
                                               arg=arg, epoch=seg.epoch if bound else 0)
            except NoAnswer as exc:
                raise self._unavailable(exc) from None
            if status == Status.STALE or (bound and epoch != seg.epoch):
                with self._lock:
                    self._seg_broken = True
                continue
            return seg, status, out
        raise StoreUnavailableError(f"store '{self.url}' unavailable: the shm server keeps restarting")

    def _request_in(self, epoch: int, op: int, frames: Sequence[bytes], *, key_len: int, flags: int, arg: int,
                    deadline: float) -> tuple[Segments, int, list[bytes]]:
        gone = StoreUnavailableError(f"store '{self.url}' unavailable: the shm server restarted during the "
                                     f"operation (what it had started is dropped)")
        if self._closed:
            raise StoreUnavailableError(f"store '{self.url}' is closed")
        seg = self._seg
        if seg is None or seg.epoch != epoch:
            raise gone
        try:
            status, reply_epoch, out = self.call(op, frames, deadline=deadline, key_len=key_len, flags=flags,
                                                 arg=arg, epoch=epoch)
        except NoAnswer as exc:
            raise self._unavailable(exc) from None
        if status == Status.STALE or reply_epoch != epoch:
            with self._lock:
                self._seg_broken = True
            raise gone
        return seg, status, out

    def close(self) -> None:
        """Close the sockets and unmap the segments; later requests raise
        ``StoreUnavailableError``.  Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sockets, self._sockets = self._sockets, set()
            segs = [s for s in (self._seg, *self._old_segs) if s is not None]
            self._seg = None
            self._old_segs = []
        if os.getpid() == self.pid:
            for sock in sockets:
                sock.close()
        for seg in segs:
            seg.release()
