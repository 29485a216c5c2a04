"""Messages between an shm client and its server over a unix stream socket.

A message is a list of frames (``protocol`` says what each holds), sent as
a u32 frame count, a u64 length per frame, then the frames' bytes, all
little-endian.  One socket carries one request at a time and its reply, in
order.  Owns that framing and both ends' ways of moving it: a client's
send and receive within a deadline (``send``, ``receive``), and a server's
incremental reader and non-blocking writer for many connections
(``Inbox``, ``Outbox``).  Must not know what a frame means, the server's
state or the client's reconnects (``connection``, ``server``).

A plain unix socket costs a fraction of a ZeroMQ one here: no I/O thread
between the caller and the kernel on either side, so a request and its
reply take one wake-up of each process.
"""

from __future__ import annotations

import math
import select
import socket
import struct
import time
from typing import Callable, Sequence

_COUNT = struct.Struct("<I")
#: A message may hold at most this many frames, and this many bytes; more
#: is a broken or hostile peer.
MAX_FRAMES = 64
MAX_NBYTES = 1 << 31
_RECV_NBYTES = 1 << 20
#: Servers before this transport spoke ZeroMQ, whose greeting begins with
#: this byte (and, read as a frame count, is far above ``MAX_FRAMES``).
ZMTP_SIGNATURE_START = b"\xff"
OLDER_SERVER = "it is of an older version that speaks ZeroMQ"
_FIRST_RECV_NBYTES = 1 << 16


class PeerGone(Exception):
    """The other end closed the connection, or sent what is not a message."""


def _pack_header(frames: Sequence) -> bytes:
    lengths = [memoryview(f).nbytes for f in frames]
    return struct.pack(f"<I{len(lengths)}Q", len(lengths), *lengths)


def _parse_header(buf, start: int = 0) -> tuple[int, list[int]] | None:
    """(header size, frame lengths) of the message at ``start``, or None
    while the header is incomplete.  Raises ``PeerGone`` for a bad one."""
    if len(buf) - start < _COUNT.size:
        return None
    (count,) = _COUNT.unpack_from(buf, start)
    if count > MAX_FRAMES:
        if bytes(buf[start:start + 1]) == ZMTP_SIGNATURE_START:
            raise PeerGone(OLDER_SERVER)
        raise PeerGone(f"a message of {count} frames")
    size = _COUNT.size + 8 * count
    if len(buf) - start < size:
        return None
    lengths = list(struct.unpack_from(f"<{count}Q", buf, start + _COUNT.size))
    if sum(lengths) > MAX_NBYTES:
        raise PeerGone(f"a message of {sum(lengths)} bytes")
    return size, lengths


def _split(data: memoryview, lengths: list[int]) -> list[memoryview]:
    frames = []
    pos = 0
    for n in lengths:
        frames.append(data[pos:pos + n])
        pos += n
    return frames


def send(sock: socket.socket, frames: Sequence, deadline: float, still_waiting: Callable[[], bool],
         slice_s: float = 0.05) -> bool:
    """Send one message on a non-blocking socket, waiting for room until
    ``deadline`` at most and asking ``still_waiting()`` every ``slice_s``:
    whether all of it went (False: the socket holds part of a message and
    must not be used again).  Raises ``OSError`` when the peer is gone."""
    views = [memoryview(_pack_header(frames))] + [memoryview(f).cast("B") for f in frames]
    views = [v for v in views if v.nbytes]
    poller = None
    while views:
        try:
            sent = sock.sendmsg(views[:512])
        except BlockingIOError:
            if poller is None:
                poller = select.poll()
                poller.register(sock, select.POLLOUT)
            if not poller.poll(_wait_ms(deadline, slice_s)):
                if time.monotonic() >= deadline or not still_waiting():
                    return False
            continue
        _advance(views, sent)
    return True


def _advance(views: list[memoryview], sent: int) -> None:
    """Drop the first ``sent`` bytes of ``views`` (what ``sendmsg`` took)."""
    while views and sent >= views[0].nbytes:
        sent -= views[0].nbytes
        views.pop(0)
    if sent:
        views[0] = views[0][sent:]


def _wait_ms(deadline: float, slice_s: float) -> int:
    return max(0, min(math.ceil(slice_s * 1000), math.ceil((deadline - time.monotonic()) * 1000)))


def receive(sock: socket.socket, deadline: float, still_waiting: Callable[[], bool],
            slice_s: float = 0.05) -> list[bytes] | None:
    """Receive one message on a non-blocking socket, waiting until
    ``deadline`` (monotonic seconds) at most and asking ``still_waiting()``
    every ``slice_s`` of waiting: None when it says to give up or the
    deadline passes.  Raises ``PeerGone`` when the server closes the
    connection or sends what is not one reply."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    buf = bytearray()
    header = None
    need = _COUNT.size
    while True:
        if len(buf) < need:
            try:
                chunk = sock.recv(min(_RECV_NBYTES, need - len(buf)) if header else _FIRST_RECV_NBYTES)
            except BlockingIOError:
                if not poller.poll(_wait_ms(deadline, slice_s)):
                    if time.monotonic() >= deadline or not still_waiting():
                        return None
                continue
            if not chunk:
                raise PeerGone("the shm server closed the connection")
            buf += chunk
        if header is None:
            header = _parse_header(buf)
            if header is None:
                need = len(buf) + 8
                continue
            need = header[0] + sum(header[1])
        if len(buf) >= need:
            if len(buf) > need:
                raise PeerGone("the shm server sent more than its reply")
            data = memoryview(buf)[header[0]:]
            return [bytes(frame) for frame in _split(data, header[1])]


class Inbox:
    """A server's reader of one connection: feed it what ``recv`` returns,
    take the complete messages."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[list[memoryview]]:
        self._buf += data
        messages = []
        start = 0
        buf = self._buf
        while True:
            header = _parse_header(buf, start)
            if header is None:
                break
            end = start + header[0] + sum(header[1])
            if len(buf) < end:
                break
            messages.append(_split(memoryview(bytes(buf[start + header[0]:end])), header[1]))
            start = end
        if start:
            del buf[:start]
        return messages


class Outbox:
    """A server's writer of one non-blocking connection: what could not be
    sent yet waits here, so that a client that does not read never blocks
    the server."""

    def __init__(self) -> None:
        self._views: list[memoryview] = []

    @property
    def pending(self) -> bool:
        return bool(self._views)

    def put(self, frames: Sequence) -> None:
        self._views.append(memoryview(_pack_header(frames)))
        self._views.extend(v for v in (memoryview(f).cast("B") for f in frames) if v.nbytes)

    def flush(self, sock: socket.socket) -> bool:
        """Send what the socket takes now; whether everything went.  Raises
        ``OSError`` when the client is gone."""
        views = self._views
        while views:
            try:
                sent = sock.sendmsg(views[:512])
            except BlockingIOError:
                return False
            _advance(views, sent)
        return True
