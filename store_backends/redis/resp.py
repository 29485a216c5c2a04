"""The RESP2 wire codec of the Redis stores: commands written as bytes,
replies read off a socket.

This module owns the encoding of the few commands the hot path sends, the
reader that takes replies apart (bulk payloads go from the socket straight
into the caller's memory), and the deadline every send and read of one call
shares.  It sees only a socket and bytes: it must not know of redis-py, of
namespaces or of which server a key lives on, and it never opens, closes
or retries a connection (the store disconnects a connection whose exchange
failed half-way).
"""

from __future__ import annotations

import socket
import ssl
import time
from typing import Callable, Sequence

# The reader below speaks RESP2: there the server never slips push messages
# (RESP3) in between the replies of a pipeline.  Connections are opened with
# this protocol.
PROTOCOL = 2

# Values at least this large are sent as their own buffer instead of being
# joined with the command around them (a copy that costs more than the
# extra iovec saves).
JOIN_BELOW = 16 * 1024
# Commands per joined buffer when pipelining one-key commands: bounds each
# join while keeping the system calls few.
PIPELINE_CHUNK = 512
_IOV_MAX = 512

GET = b"*2\r\n$3\r\nGET\r\n"
IDLETIME = b"*3\r\n$6\r\nOBJECT\r\n$8\r\nIDLETIME\r\n"
EXISTS = b"*2\r\n$6\r\nEXISTS\r\n"
DEL = b"*2\r\n$3\r\nDEL\r\n"
ONE = ord("1")


def time_left(deadline: float) -> float:
    """Seconds to the deadline of the current call; ``socket.timeout`` once
    it has passed, as a socket wait that ran out would raise."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("timed out")
    return left


class ReplyError(Exception):
    """An error reply (``-ERR ...``) to one command of a pipeline."""


class Unavailable(Exception):
    """An error reply that means the server cannot serve at all right now
    (cluster down, still loading, authentication lost)."""


_UNAVAILABLE_PREFIXES = ("CLUSTERDOWN", "LOADING", "NOAUTH", "WRONGPASS", "MASTERDOWN", "TRYAGAIN", "BUSY")


def is_redirect(exc: ReplyError) -> bool:
    """A cluster node said the key's slot lives elsewhere."""
    return str(exc).startswith(("MOVED ", "ASK "))


def command(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%b\r\n" % (len(a), a) for a in args)


# Inspection reads are wrapped in CLIENT NO-TOUCH (Redis 7.2+) so that they do
# not count as uses for Redis's LRU/LFU; older servers answer an error, which
# is read and ignored (there a peek is a use).
NO_TOUCH_ON = command(b"CLIENT", b"NO-TOUCH", b"ON")
NO_TOUCH_OFF = command(b"CLIENT", b"NO-TOUCH", b"OFF")


def pack(head: bytes, prefix: bytes, keys: Sequence[bytes]) -> list[bytes]:
    """``head`` + one ``prefix + key`` argument per command, in writes of
    ``PIPELINE_CHUNK`` commands."""
    out = []
    for start in range(0, len(keys), PIPELINE_CHUNK):
        part = keys[start:start + PIPELINE_CHUNK]
        lengths = set(map(len, part))
        if len(lengths) == 1:
            # Content addresses have one length: one join builds the lot.
            sep = b"\r\n" + head + b"$%d\r\n" % (len(prefix) + lengths.pop()) + prefix
            out.append(sep[2:] + sep.join(part) + b"\r\n")
        else:
            out.append(b"".join([b"%b$%d\r\n%b%b\r\n" % (head, len(prefix) + len(k), prefix, k)
                                 for k in part]))
    return out


class Reader:
    """RESP2 replies read off a socket through a small buffer; bulk payloads
    go straight into the caller's memory."""

    __slots__ = ("_sock", "_deadline", "_buf", "_view", "_start", "_end")

    def __init__(self, sock: socket.socket, deadline: float | None = None, size: int = 64 * 1024) -> None:
        self._sock = sock
        self._deadline = deadline
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    def _recv(self, need: int = 1) -> None:
        """Read at least once, with room for ``need`` buffered bytes."""
        live = self._end - self._start
        if live == 0:
            self._start = self._end = 0
        if len(self._buf) - self._start < max(need, live + 1):
            if len(self._buf) < need or live == len(self._buf):
                grown = bytearray(max(need, 2 * len(self._buf)))
                grown[:live] = self._view[self._start:self._end]
                self._buf = grown
                self._view = memoryview(grown)
            else:
                self._buf[:live] = bytes(self._view[self._start:self._end])
            self._start, self._end = 0, live
        if self._deadline is not None:
            self._sock.settimeout(time_left(self._deadline))
        n = self._sock.recv_into(self._view[self._end:])
        if n == 0:
            raise ConnectionError("the server closed the connection")
        self._end += n

    def fill(self, nbytes: int) -> memoryview:
        """The next ``nbytes`` bytes, without consuming them."""
        while self._end - self._start < nbytes:
            self._recv(nbytes)
        return self._view[self._start:self._start + nbytes]

    def line(self) -> bytes:
        while True:
            i = self._buf.find(b"\r\n", self._start, self._end)
            if i >= 0:
                line = bytes(self._view[self._start:i])
                self._start = i + 2
                return line
            self._recv(self._end - self._start + 1)

    def head(self) -> bytes:
        """The next reply's first line; an error reply raises."""
        line = self.line()
        if line[:1] == b"-":
            text = line[1:].decode("utf-8", "replace")
            if text.startswith(_UNAVAILABLE_PREFIXES):
                raise Unavailable(text)
            raise ReplyError(text)
        return line

    def status(self) -> None:
        """A simple-string or integer reply; an error reply raises."""
        line = self.head()
        if line[:1] not in (b"+", b":"):
            raise ConnectionError(f"unexpected reply {line[:40]!r}")

    def integer(self) -> int:
        line = self.head()
        if line[:1] != b":":
            raise ConnectionError(f"unexpected reply {line[:40]!r}")
        return int(line[1:])

    def bulk_len(self) -> int:
        """The length of a bulk reply, -1 for nil; the payload (and its
        CRLF) must then be consumed with one of the methods below."""
        line = self.head()
        if line == b"_":
            return -1
        if line[:1] != b"$":
            raise ConnectionError(f"unexpected reply {line[:40]!r}")
        return int(line[1:])

    def bulk_into(self, dest: memoryview, n: int) -> None:
        have = min(self._end - self._start, n)
        if have:
            dest[:have] = self._view[self._start:self._start + have]
            self._start += have
        while have < n:
            if self._deadline is not None:
                self._sock.settimeout(time_left(self._deadline))
            got = self._sock.recv_into(dest[have:n], n - have)
            if got == 0:
                raise ConnectionError("the server closed the connection")
            have += got
        self.skip(2)

    def bulk_bytes(self, n: int) -> bytes:
        if self._end - self._start >= n + 2:
            value = bytes(self._view[self._start:self._start + n])
            self._start += n + 2
            return value
        out = bytearray(n)
        self.bulk_into(memoryview(out), n)
        return bytes(out)

    def skip(self, n: int) -> None:
        while n > 0:
            if self._start == self._end:
                self._recv()
            step = min(n, self._end - self._start)
            self._start += step
            n -= step


def ignore_error(read: Callable[[], object]) -> None:
    """Read one reply and ignore an error reply (an optional command)."""
    try:
        read()
    except ReplyError:
        pass


def send(sock: socket.socket, chunks: list, deadline: float | None = None) -> None:
    """Write all chunks, gathering them into few system calls, by ``deadline``."""
    if isinstance(sock, ssl.SSLSocket) or not hasattr(sock, "sendmsg"):
        for chunk in chunks:
            if deadline is not None:
                sock.settimeout(time_left(deadline))
            sock.sendall(chunk)
        return
    i = 0
    while i < len(chunks):
        batch = chunks[i:i + _IOV_MAX]
        if deadline is not None:
            sock.settimeout(time_left(deadline))
        sent = sock.sendmsg(batch)
        for chunk in batch:
            size = len(chunk)
            if sent >= size:
                sent -= size
                i += 1
                continue
            # A partial write: the rest of this chunk goes first next round.
            chunks[i] = memoryview(chunk)[sent:]
            break
