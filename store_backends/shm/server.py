"""The index server of an ``shm://NAME`` store: one process per NAME and host.

The values live in a shared-memory data segment that every client maps, and
the server never touches them.  It keeps the LRU index ``key -> chunks +
size`` (``index.ChunkIndex``: the state and the ops on it) and bumps a
per-chunk generation counter (in a small second segment that clients map
read-only) whenever it frees a chunk.  A reader copies a value and then
re-reads the generation of the value's first chunk: if it changed, the value
may have been overwritten during the copy and the read is a miss.  Readers
therefore pin nothing, and a reader that dies leaves nothing behind.  A
third segment, the key table (``keytable``), lets clients answer lookups
without a request, and a fourth (``locations``) lets them find a stored
value's chunks without one.

Writers allocate chunks under a lease (one request), copy their values in,
and commit (a second request); a value becomes visible only at commit.  The
leases of writers whose process is gone are reclaimed by a periodic sweep; a
lease that is merely old is reclaimed only after ``lease_timeout``, because
reclaiming chunks that a live, slow writer is still filling would corrupt
their next owner.

This module owns the server process: its PID lock, creating and removing
the segments, the control socket, the request loop (dispatch, stale epochs,
the sweep, the idle exit), signals, detaching a started server, and its
command line, ``python -m store_backends.shm_server serve|stop|status NAME``
(``main``).  Must not keep the index itself (``index``), and must not be
imported by engines or operators for anything but starting a server: the
wire format is ``protocol``'s, file names are ``paths``', and asking a
running server anything is ``admin``'s or the client's.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import secrets
import selectors
import signal
import socket
import sys
import time

import numpy as np

from . import keytable, locations
from .index import ChunkIndex, Entry, Lease
from .paths import SEGMENT_DIR, Paths, UnsafeRuntimeDir, lock_until, valid_name
from .protocol import (DEFAULT_CHUNK_NBYTES, DEFAULT_LEASE_TIMEOUT_S, EPOCH_FREE_OPS, EXIT_ALREADY_RUNNING,
                       NO_REPLY_OPS, PROTOCOL_VERSION, REPLY, REQUEST, Op, Status)
from .transport import Inbox, Outbox, PeerGone

__all__ = ["ChunkIndex", "Entry", "IndexServer", "Lease", "SWEEP_INTERVAL_S", "main"]

SWEEP_INTERVAL_S = 0.5
#: What one recv of a client's socket takes at most: a larger buffer costs
#: an mmap and its page faults on every request, however small.
_RECV_NBYTES = 64 << 10
# How long a starting server waits for the PID lock: a client probing
# liveness holds it shared for an instant; a live server holds it for good.
_PID_LOCK_WAIT_S = 2.0


class _Client:
    """What the server keeps of one connected client."""

    __slots__ = ("inbox", "outbox", "waiting")

    def __init__(self) -> None:
        self.inbox = Inbox()
        self.outbox = Outbox()
        self.waiting = False    # for room to send a reply (the selector waits to write, not to read)


class IndexServer:
    """The server of store NAME: serves ``ChunkIndex`` over the control
    socket, within one epoch of segments."""

    def __init__(self, name: str, *, capacity_nbytes: int, chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
                 idle_timeout_s: float | None = None, lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S,
                 prefault: bool = True, rundir: str | None = None) -> None:
        if chunk_nbytes <= 0 or chunk_nbytes % 64:
            raise ValueError(f"chunk={chunk_nbytes} must be a positive multiple of 64 bytes")
        num_chunks = capacity_nbytes // chunk_nbytes
        if num_chunks < 1:
            raise ValueError(f"capacity={capacity_nbytes} is smaller than one chunk ({chunk_nbytes} bytes)")
        if num_chunks >= 2**31:
            raise ValueError("capacity / chunk must be below 2**31 chunks; use a larger chunk")
        self.paths = Paths(name, rundir)
        self.name = name
        self.chunk_nbytes = chunk_nbytes
        self.num_chunks = num_chunks
        self.idle_timeout_s = idle_timeout_s
        self.lease_timeout_s = lease_timeout_s
        self.prefault = prefault
        self.epoch = int.from_bytes(secrets.token_bytes(8), "little") or 1
        self.chunks = ChunkIndex(num_chunks, chunk_nbytes, lease_timeout_s)
        self.chunks.epoch = self.epoch
        self.stopping = False
        self.pid_fd = -1
        self._gen_mm = None
        self._keys_mm = None
        self.keys_path: str | None = None
        self.key_table_slots = keytable.table_slots(num_chunks) if keytable.supported() else 0
        self._where_mm = None
        self.where_path: str | None = None
        self.publish_locations = bool(self.key_table_slots) and locations.published(chunk_nbytes)
        self.started = time.time()

    # -- life cycle

    def acquire_pid_lock(self) -> bool:
        self.paths.ensure_rundir()
        fd = os.open(self.paths.pid_lock, os.O_RDWR | os.O_CREAT, 0o600)
        if not lock_until(fd, time.monotonic() + _PID_LOCK_WAIT_S):
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.pid_fd = fd
        return True

    def create_segments(self) -> None:
        # The PID lock proves no other server of this NAME is alive, so any
        # segment of this NAME is a dead server's leftover.
        for path in self.paths.leftover_segments():
            _unlink(path)
        data_nbytes = self.num_chunks * self.chunk_nbytes
        st = os.statvfs(SEGMENT_DIR)
        if data_nbytes > st.f_bavail * st.f_frsize:
            raise ValueError(f"capacity {data_nbytes} bytes exceeds the free space in {SEGMENT_DIR} "
                             f"({st.f_bavail * st.f_frsize} bytes); lower capacity")
        data_path = self.paths.segment(self.epoch, "data")
        gen_path = self.paths.segment(self.epoch, "gen")
        fd = os.open(data_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, data_nbytes)
            if self.prefault:
                # Reserve the memory now: a tmpfs page that cannot be
                # allocated later would kill a client with SIGBUS mid-copy.
                os.posix_fallocate(fd, 0, data_nbytes)
        except OSError:
            os.close(fd)
            _unlink(data_path)
            raise
        os.close(fd)
        self._gen_mm = _create_mapped(gen_path, self.num_chunks * 8)
        self.chunks.gen = np.frombuffer(self._gen_mm, dtype=np.uint64)
        self.data_path = data_path
        self.gen_path = gen_path
        if self.key_table_slots:
            keys_path = self.paths.segment(self.epoch, "keys")
            self._keys_mm = _create_mapped(keys_path, keytable.segment_nbytes(self.key_table_slots))
            self.keys_path = keys_path
            self.chunks.table = keytable.KeyTableWriter(self._keys_mm, self.key_table_slots)
        if self.publish_locations:
            where_path = self.paths.segment(self.epoch, "where")
            self._where_mm = _create_mapped(
                where_path, locations.segment_nbytes(self.key_table_slots, self.num_chunks))
            self.where_path = where_path
            self.chunks.where = locations.LocationWriter(self._where_mm, self.key_table_slots, self.num_chunks)

    def cleanup(self) -> None:
        if self.chunks.table is not None:
            self.chunks.table.close()   # a client that still maps it asks, and finds us gone
        _unlink(self.paths.socket)
        for path in (getattr(self, "data_path", None), getattr(self, "gen_path", None), self.keys_path,
                     self.where_path):
            if path:
                _unlink(path)
        # The PID lock stays held until the process is gone (the kernel drops
        # it at exit), so "no server running" also means "no server process".

    def serve(self, ready_fd: int = -1) -> int:
        if not self.acquire_pid_lock():
            _report(ready_fd, "already running")
            return EXIT_ALREADY_RUNNING
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.create_segments()
            _unlink(self.paths.socket)
            sock.bind(self.paths.socket)
            os.chmod(self.paths.socket, 0o600)
            sock.listen(128)
            sock.setblocking(False)
        except Exception as exc:
            _report(ready_fd, f"error: {exc}")
            self.cleanup()
            sock.close()
            return 1
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        _report(ready_fd, "ok")
        try:
            self._loop(sock)
        finally:
            self.cleanup()
            sock.close()
        return 0

    def _on_signal(self, signum, frame) -> None:
        self.stopping = True

    def _loop(self, sock) -> None:
        last_request = last_sweep = time.monotonic()
        chunks = self.chunks
        handlers = {
            Op.HELLO: self._op_hello, Op.CONTAINS: chunks.op_contains, Op.PREFIX: chunks.op_prefix,
            Op.GET: chunks.op_get, Op.ALLOC: chunks.op_alloc, Op.COMMIT: chunks.op_commit,
            Op.ABORT: chunks.op_abort, Op.DELETE: chunks.op_delete, Op.STATS: self._op_stats,
            Op.CLEAR: chunks.op_clear, Op.SHUTDOWN: self._op_shutdown, Op.KEYS: chunks.op_keys,
            Op.TOUCH: chunks.op_touch, Op.DECLARE: chunks.op_declare,
        }
        selector = selectors.DefaultSelector()
        selector.register(sock, selectors.EVENT_READ)
        # A signal wakes the select at once (it is retried after a signal).
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        try:
            old_wakeup = signal.set_wakeup_fd(wake_w.fileno())
        except ValueError:          # not the main thread: signals are noticed within a sweep
            old_wakeup = None
        selector.register(wake_r, selectors.EVENT_READ)
        try:
            while not self.stopping:
                ready = selector.select(SWEEP_INTERVAL_S)
                for key, events in ready:
                    if key.fileobj is sock:
                        self._accept(sock, selector)
                    elif key.fileobj is wake_r:
                        _drain(wake_r)
                    else:
                        self._serve_client(key.fileobj, key.data, events, selector, handlers)
                if ready:
                    last_request = time.monotonic()
                now = time.monotonic()
                if now - last_sweep >= SWEEP_INTERVAL_S:
                    chunks.sweep(now)
                    last_sweep = now
                if (self.idle_timeout_s is not None and now - last_request > self.idle_timeout_s
                        and not chunks.leases):
                    break
        finally:
            if old_wakeup is not None:
                signal.set_wakeup_fd(old_wakeup)
            for key in list(selector.get_map().values()):
                if key.fileobj is not sock:
                    key.fileobj.close()
            selector.close()
            wake_w.close()

    @staticmethod
    def _accept(sock, selector) -> None:
        while True:
            try:
                conn, _addr = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return      # out of file descriptors, say: the client retries within its timeout
            conn.setblocking(False)
            selector.register(conn, selectors.EVENT_READ, _Client())

    def _serve_client(self, conn, client: "_Client", events: int, selector, handlers) -> None:
        """Read what the client sent, answer each whole request, and send
        what the socket takes; a client that is gone or sends garbage is
        dropped."""
        try:
            if events & selectors.EVENT_READ:
                while not client.outbox.pending:
                    try:
                        data = conn.recv(_RECV_NBYTES)
                    except (BlockingIOError, InterruptedError):
                        break
                    if not data:
                        raise PeerGone("closed")
                    for message in client.inbox.feed(data):
                        reply = self._handle(handlers, message)
                        if reply is not None:
                            client.outbox.put(reply)
                    if len(data) < _RECV_NBYTES:
                        break
            done = client.outbox.flush(conn)
        except (OSError, PeerGone):
            selector.unregister(conn)
            conn.close()
            return
        # While a reply waits for room, read nothing more from this client.
        if client.waiting == done:
            client.waiting = not done
            selector.modify(conn, selectors.EVENT_READ if done else selectors.EVENT_WRITE, client)

    def _handle(self, handlers, message: list) -> list | None:
        if not message or message[0].nbytes != REQUEST.size:
            raise PeerGone("not a request")
        op, flags, key_len, rid, epoch, arg = REQUEST.unpack(message[0])
        # An op of NO_REPLY_OPS gets nothing back, also not a refusal: the
        # request that follows finds its effect missing and is answered for both.
        answered = op not in NO_REPLY_OPS
        if epoch != self.epoch and op not in EPOCH_FREE_OPS:
            return [REPLY.pack(Status.STALE, rid, self.epoch)] if answered else None
        handler = handlers.get(op)
        try:
            if handler is None:
                raise ValueError(f"unknown op {op}")
            answer = handler(flags, key_len, arg, message[1:])
        except Exception as exc:  # a bad request must not take the server down
            if not answered:
                self.chunks.counters["requests_refused"] += 1
            answer = Status.ERROR, [f"{type(exc).__name__}: {exc}".encode()]
        if not answered:
            return None
        status, frames = answer
        return [REPLY.pack(status, rid, self.epoch), *frames]

    # -- the ops that are the server's, not the index's

    def _info(self) -> dict:
        return {
            "protocol": PROTOCOL_VERSION, "name": self.name, "epoch": self.epoch, "pid": os.getpid(),
            "chunk_nbytes": self.chunk_nbytes, "num_chunks": self.num_chunks,
            "data_path": self.data_path, "gen_path": self.gen_path,
            "keys_path": self.keys_path, "key_table_slots": self.key_table_slots,
            "where_path": self.where_path,
            # Reservations (Flag.RESERVE) are offered, to be used within this long of their answer.
            "reserve_use_s": self.lease_timeout_s / 2,
            "cpus": sorted(os.sched_getaffinity(0)),
        }

    def _op_hello(self, flags, key_len, arg, frames):
        return Status.OK, [json.dumps(self._info()).encode()]

    def _op_stats(self, flags, key_len, arg, frames):
        info = self._info()
        info.update(self.chunks.figures())
        if self.chunks.table is not None:
            info.update(self.chunks.table.figures())
        info.update({
            "uptime_s": time.time() - self.started,
            "idle_timeout_s": self.idle_timeout_s, "lease_timeout_s": self.lease_timeout_s,
        })
        info.update(self.chunks.counters)
        return Status.OK, [json.dumps(info).encode()]

    def _op_shutdown(self, flags, key_len, arg, frames):
        self.stopping = True
        return Status.OK, []


def _drain(sock) -> None:
    try:
        while sock.recv(4096):
            pass
    except (BlockingIOError, InterruptedError):
        pass


def _create_mapped(path: str, nbytes: int) -> mmap.mmap:
    """A new segment file of ``nbytes``, reserved and mapped read-write."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        _unlink(path)
        raise
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _report(fd: int, text: str) -> None:
    if fd < 0:
        if text != "ok":
            print(text, file=sys.stderr)
        return
    try:
        os.write(fd, text.encode() + b"\n")
    except BrokenPipeError:
        pass  # the starter stopped waiting (its operation's timeout); serve anyway, a later call finds us
    finally:
        os.close(fd)


def _serve_detached(server: IndexServer) -> int:
    """Fork the real server into its own session and exit once it is ready,
    so the starter neither waits on it nor has to reap it."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write_fd)
        chunks = []
        while True:
            data = os.read(read_fd, 4096)
            if not data:
                break
            chunks.append(data)
        os.close(read_fd)
        text = b"".join(chunks).decode(errors="replace").strip()
        if text == "ok":
            return 0
        if text == "already running":
            return EXIT_ALREADY_RUNNING
        print(text or "the shm server exited before it was ready", file=sys.stderr)
        return 1
    os.close(read_fd)
    os.setsid()
    server.paths.ensure_rundir()
    devnull = os.open(os.devnull, os.O_RDWR)
    log = os.open(server.paths.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(devnull)
    os.close(log)
    try:
        code = server.serve(ready_fd=write_fd)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """``python -m store_backends.shm_server serve|stop|status NAME``."""
    from ..base import StoreOpenError
    from ..urls import parse_cpus, parse_seconds, parse_size
    from .admin import server_status, stop_server

    parser = argparse.ArgumentParser(prog="python -m store_backends.shm_server",
                                     description="The index server of an shm:// store.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the server of NAME (in the foreground unless --detach)")
    serve.add_argument("name")
    serve.add_argument("--capacity", default="1GiB")
    serve.add_argument("--chunk", default=str(DEFAULT_CHUNK_NBYTES))
    serve.add_argument("--idle-timeout", default=None, help="exit after this long without requests")
    serve.add_argument("--lease-timeout", default=str(DEFAULT_LEASE_TIMEOUT_S))
    serve.add_argument("--no-prefault", action="store_true", help="do not reserve the memory up front")
    serve.add_argument("--runtime-dir", default=None)
    serve.add_argument("--cpus", default=None, metavar="LIST",
                       help="run on these CPUs only, as taskset -c writes them (3, 2-3, 0,2-3)")
    serve.add_argument("--detach", action="store_true", help="run in the background; exit once ready")
    for command in ("stop", "status"):
        p = sub.add_parser(command, help=f"{command} the server of NAME")
        p.add_argument("name")
        p.add_argument("--runtime-dir", default=None)
    args = parser.parse_args(argv)
    if not valid_name(args.name):
        parser.error(f"NAME {args.name!r} may hold only letters, digits, '-', '_' and '.'")
    try:
        if args.command == "serve":
            # Before detaching, so that the starter sees the refusal.
            Paths(args.name, args.runtime_dir).ensure_rundir()
        else:
            Paths(args.name, args.runtime_dir).check_rundir()
    except UnsafeRuntimeDir as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.command == "stop":
        stopped = stop_server(args.name, args.runtime_dir)
        print("stopped" if stopped else f"no shm server is running for {args.name!r}")
        return 0 if stopped else 1
    if args.command == "status":
        status = server_status(args.name, args.runtime_dir)
        if not status.answering:
            print(f"no shm server is running for {args.name!r}")
            return 1
        print(json.dumps(status.to_dict(), indent=2, sort_keys=True))
        return 0
    if args.command == "serve" and args.cpus is not None:
        try:
            os.sched_setaffinity(0, parse_cpus(args.cpus, name="--cpus"))
        except StoreOpenError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except OSError:
            print(f"error: --cpus={args.cpus!r} names no CPU this process may run on (it may run on "
                  f"{','.join(map(str, sorted(os.sched_getaffinity(0))))})", file=sys.stderr)
            return 1
    try:
        server = IndexServer(
            args.name,
            capacity_nbytes=parse_size(args.capacity),
            chunk_nbytes=parse_size(args.chunk, name="chunk"),
            idle_timeout_s=parse_seconds(args.idle_timeout, name="idle_timeout") if args.idle_timeout else None,
            lease_timeout_s=parse_seconds(args.lease_timeout, name="lease_timeout"),
            prefault=not args.no_prefault,
            rundir=args.runtime_dir,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.detach:
        return _serve_detached(server)
    return server.serve()


if __name__ == "__main__":
    sys.exit(main())
