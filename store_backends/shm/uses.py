"""What an shm client owes its server's counters and LRU order.

A client reads some values without a request (from the published
locations, ``locations``), and finds some reads it was answered for torn or
mis-sized after the server counted them as hits.  ``Uses`` keeps both until
they are sent: the keys read and the gets and hits to count (sent as a
``TOUCH``, or along with a put's ALLOC), and the late misses (sent in the
arg of the next counted request).  Owns only this bookkeeping and the
frames that carry it (``protocol.TOUCH_COUNTS``); must not send anything:
the client (``client``) decides when.
"""

from __future__ import annotations

import threading

from .protocol import TOUCH_COUNTS, pack_keys

#: Uses are sent to the server once this many keys are pending (and before
#: a put, a stats or a key listing, and when the client closes).
TOUCH_FLUSH_KEYS = 4096


class Uses:
    """Thread-safe; one per client."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: list[bytes] = []
        self._gets = 0
        self._hits = 0
        self._late = 0
        #: Reads found torn (a value reused during the copy), for ``stats``.
        self.torn = 0
        #: Gets answered from the published locations, for ``stats``.
        self.local_gets = 0

    def read_locally(self, hit_keys: list[bytes], gets: int) -> bool:
        """Note ``gets`` keys read without a request, ``hit_keys`` of them
        found; whether enough are pending to send them now."""
        with self._lock:
            self._keys.extend(hit_keys)
            self._gets += gets
            self._hits += len(hit_keys)
            self.local_gets += gets
            return len(self._keys) >= TOUCH_FLUSH_KEYS

    def missed_late(self, late: int, torn: int) -> None:
        """``late`` reads counted as hits were misses (``torn`` of them torn)."""
        if late or torn:
            with self._lock:
                self._late += late
                self.torn += torn

    def take_late(self) -> int:
        with self._lock:
            late, self._late = self._late, 0
        return late

    @property
    def pending(self) -> bool:
        return bool(self._gets)

    def take(self, with_late: bool) -> tuple[list[bytes], int, int, int] | None:
        """(keys, gets, hits, late misses), no longer pending; None when
        there is nothing to send.  Without ``with_late`` the late misses
        stay for a request whose arg can carry them."""
        with self._lock:
            if not self._gets and not (with_late and self._late):
                return None
            taken = (self._keys, self._gets, self._hits, self._late if with_late else 0)
            self._keys, self._gets, self._hits = [], 0, 0
            if with_late:
                self._late = 0
        return taken

    @staticmethod
    def frames(keys: list[bytes], gets: int, hits: int) -> list[bytes]:
        """The frames of a TOUCH (and of a put's ALLOC flagged TOUCHED)."""
        key_len, key_frames = pack_keys(keys)
        return [TOUCH_COUNTS.pack(key_len, gets, hits), *key_frames]
