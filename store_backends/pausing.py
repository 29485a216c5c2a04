"""A store that stops asking a medium that stopped answering, for a while.

A store whose medium hangs (a server stopped by a debugger or a full swap, a
host that drops packets) raises ``StoreUnavailableError`` only once its
``timeout`` has passed.  An engine that asked it again on every lookup, load
and save would wait that long each time.  ``PausingStore`` wraps one store:

* after a call fails with ``StoreUnavailableError``, calls fail at once with
  the same error for a pause (``MIN_PAUSE_S``, doubled after each failure in
  a row, at most ``MAX_PAUSE_S``), naming the store and the first error;
* meanwhile a background thread asks the medium (``contains`` of one key)
  each time the pause ends, until it answers; then calls go through again;
* a call that succeeds ends the run of failures (the pause starts again from
  ``MIN_PAUSE_S``).  A medium that answers the probe but fails real calls
  (one node of a cluster) is paused longer each time.

Errors other than ``StoreUnavailableError`` (a damaged value, a bad key)
pass through and pause nothing.  ``stats``, ``close`` and the operators'
calls (``iter_keys``, ``peek``, ``last_used``) are never paused.
``pause_unavailable`` wraps a store, or each tier of a tier, so that one
hung tier pauses only itself.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterator, Sequence

from .base import Buffer, KVStore, StoreStats, StoreUnavailableError

logger = logging.getLogger(__name__)

#: The first pause after a medium stopped answering, and the longest.
MIN_PAUSE_S = 1.0
MAX_PAUSE_S = 60.0

#: The key the probe asks for (any key: only the answer's arrival counts).
PROBE_KEY = b"ucm-probe"


class PausingStore(KVStore):
    """``inner``, not asked for a while after its medium stopped answering."""

    def __init__(self, inner: KVStore, *, min_pause_s: float = MIN_PAUSE_S, max_pause_s: float = MAX_PAUSE_S,
                 clock: Callable[[], float] = time.monotonic, on_pause: Callable[[], object] | None = None) -> None:
        self.inner = inner
        # Called once each time a run of failures begins (a metric).
        self._on_pause = on_pause
        self.url = inner.url
        self.min_pause_s = min_pause_s
        self.max_pause_s = max_pause_s
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pause = min_pause_s
        self._paused_until = 0.0
        self._paused = False      # a run of failures is going on
        self._first_error = ""
        self._since = 0.0
        self._prober: threading.Thread | None = None
        self._closed = False

    # -- the pause ---------------------------------------------------------

    def paused_for(self) -> float:
        """Seconds until calls go through again (0: they do now)."""
        with self._lock:
            return max(0.0, self._paused_until - self._clock()) if self._paused else 0.0

    def _check(self) -> None:
        with self._lock:
            if not self._paused:
                return
            left = self._paused_until - self._clock()
            if left <= 0 and self._prober is None:
                return                  # the probe found it answering: try
            first = self._first_error
        wait = f"for {left:.1f}s more" if left > 0 else "until the probe asking it gets an answer"
        raise StoreUnavailableError(f"store '{self.url}' is not asked {wait}: it stopped answering ({first})")

    def _failed(self, exc: StoreUnavailableError) -> None:
        with self._lock:
            if self._closed:
                return
            now = self._clock()
            if not self._paused:
                self._paused = True
                self._first_error = str(exc)
                self._since = now
                logger.warning("store %s stopped answering (%s); not asked for %.1f s, then probed in the "
                               "background until it answers", self.url, exc, self._pause)
                if self._on_pause is not None:
                    self._on_pause()
            self._pause_again(now)
            if self._prober is None:
                self._prober = threading.Thread(target=self._probe, name="ucm-store-probe", daemon=True)
                self._prober.start()
            self._wake.notify_all()

    def _pause_again(self, now: float) -> None:
        """Pause from ``now``; the next pause of the run is twice as long
        (held: ``_lock``)."""
        self._paused_until = now + self._pause
        self._pause = min(2 * self._pause, self.max_pause_s)

    def _succeeded(self) -> None:
        if not self._paused and self._pause == self.min_pause_s:
            return
        with self._lock:
            if self._paused and self._prober is None:
                logger.warning("store %s answers again after %.1f s", self.url, self._clock() - self._since)
                self._paused = False
            if not self._paused:
                self._pause = self.min_pause_s

    def _probe(self) -> None:
        """Ask the medium each time the pause ends, until it answers."""
        while True:
            with self._lock:
                while not self._closed and self._clock() < self._paused_until:
                    self._wake.wait(timeout=max(0.0, self._paused_until - self._clock()))
                if self._closed:
                    self._prober = None
                    return
            try:
                self.inner.contains([PROBE_KEY])
            except StoreUnavailableError:
                with self._lock:
                    self._pause_again(self._clock())
                continue
            except Exception:  # noqa: BLE001 - any other answer is an answer
                pass
            with self._lock:
                self._prober = None     # calls go through; the first success ends the run
                self._paused_until = 0.0
                return

    def _call(self, fn: Callable, *args):
        self._check()
        try:
            result = fn(*args)
        except StoreUnavailableError as exc:
            self._failed(exc)
            raise
        self._succeeded()
        return result

    # -- KVStore -------------------------------------------------------------

    def put(self, keys: Sequence[bytes], values: Sequence[bytes | Buffer]) -> list[bool]:
        return self._call(self.inner.put, keys, values)

    @property
    def writes_from_parts(self) -> bool:  # type: ignore[override]
        return self.inner.writes_from_parts

    def put_parts(self, keys, parts, before_value=None) -> list[bool]:
        return self._call(self.inner.put_parts, keys, parts, before_value)

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        return self._call(self.inner.get_into, keys, buffers)

    @property
    def reads_into_parts(self) -> bool:  # type: ignore[override]
        return self.inner.reads_into_parts

    def get_into_parts(self, keys, parts, on_value=None) -> list[bool]:
        return self._call(self.inner.get_into_parts, keys, parts, on_value)

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return self._call(self.inner.get, keys)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return self._call(self.inner.contains, keys)

    def prefix_len(self, keys: Sequence[bytes]) -> int:
        return self._call(self.inner.prefix_len, keys)

    def delete(self, keys: Sequence[bytes]) -> None:
        self._call(self.inner.delete, keys)

    def stats(self) -> StoreStats:
        return self.inner.stats()

    def iter_keys(self, batch: int = 1000) -> Iterator[list[bytes]]:
        return self.inner.iter_keys(batch)

    def peek(self, keys: Sequence[bytes], nbytes: int | None = None) -> list[tuple[int, bytes] | None]:
        return self.inner.peek(keys, nbytes)

    def last_used(self, keys: Sequence[bytes]) -> list[float | None]:
        return self.inner.last_used(keys)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        self.inner.close()

    def __getattr__(self, name: str):
        # flush() and whatever else a backend offers beyond the interface.
        return getattr(self.inner, name)


def pause_unavailable(store: KVStore, on_pause: Callable[[], object] | None = None) -> KVStore:
    """``store`` wrapped in a ``PausingStore``; for a tier, each of its tiers
    in place (a hung lower tier must not pause the fast one).  ``on_pause``
    is called each time one of them begins a pause."""
    tiers = getattr(store, "stores", None)
    if isinstance(tiers, list) and tiers:
        for i, tier in enumerate(tiers):
            tiers[i] = pause_unavailable(tier, on_pause)
        return store
    return store if isinstance(store, PausingStore) else PausingStore(store, on_pause=on_pause)
