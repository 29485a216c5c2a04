"""A TCP proxy on 127.0.0.1 that limits bandwidth: a slow link in front of
a real server (a Redis), with a rate the test sets and lifts while clients
stay connected.

    proxy = ThrottleProxy(("127.0.0.1", redis_port)).start()
    url = f"redis://127.0.0.1:{proxy.port}/0"
    proxy.set_rate(200_000)      # bytes per second, each direction
    proxy.set_rate(None)         # full speed

Each direction is one shared link: every connection's bytes that way go
through one pacing clock, so two connections split the rate as they would
on a real link.  Bytes move in chunks of at most 16 KiB, each sent when the
link has had time for it.
"""

from __future__ import annotations

import socket
import threading
import time

CHUNK = 16 * 1024


class _Link:
    """One direction's pacing: a chunk may leave once the link has carried
    the bytes before it at the current rate."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free_at = 0.0
        self.rate: float | None = None
        self.nbytes = 0

    def wait(self, n: int) -> None:
        with self._lock:
            self.nbytes += n
            rate = self.rate
            if rate is None:
                return
            now = time.monotonic()
            start = max(now, self._free_at)
            self._free_at = start + n / rate
            delay = self._free_at - now
        if delay > 0:
            time.sleep(delay)


class ThrottleProxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.down = _Link()     # server -> client (what a read brings)
        self.up = _Link()       # client -> server
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()

    @property
    def rate(self) -> float | None:
        return self.down.rate

    def set_rate(self, bytes_per_s: float | None) -> None:
        """Limit each direction to ``bytes_per_s`` (None: no limit), from
        the next chunk on."""
        for link in (self.down, self.up):
            with link._lock:
                link.rate = bytes_per_s
                link._free_at = 0.0

    def start(self) -> "ThrottleProxy":
        threading.Thread(target=self._accept, name="throttle-accept", daemon=True).start()
        return self

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, self.up), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.down), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, link: _Link) -> None:
        try:
            while True:
                data = src.recv(CHUNK)
                if not data:
                    break
                link.wait(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            try:
                s.close()
            except OSError:
                pass
