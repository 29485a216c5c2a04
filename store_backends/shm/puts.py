"""An shm client's puts: chunks for the values, the copies into them, the commit.

Owns how a put reaches the server.  The plain way is two requests: ALLOC
hands out chunks for the keys not yet stored, the client copies the values
straight into them, and COMMIT makes them visible.  Where the server offers
reservations (``Segments.reserve_use_s``), each put also asks for chunks
for a next put of values of the same sizes, which the server takes from
free chunks only, never by evicting.  A next put that fits names its keys
in a message the server does not answer (DECLARE, which makes the
reservation a lease of those keys while the values are copied), copies
into the reserved chunks and commits: back-to-back puts of like batches
take one round trip each.  A reservation is used by one put at most, only
in the process and server epoch it was made for, and only within the time
the server allows (half its lease timeout; after the whole of it the
server may reclaim the chunks, so a put stalled that long mid-copy is the
one way to lose them, as for an ALLOC's).  One that does not fit is given
back with the next ALLOC (``Flag.RELEASE``), and at close.

Must not know gets, lookups, the URL or what is owed to the server's
counters (``client``, ``uses``), nor sockets and reconnects
(``connection``).
"""

from __future__ import annotations

import array
import os
import threading
import time
from typing import Callable, Sequence

from ..base import StoreError, StoreUnavailableError, copy_into_parts
from .connection import NoAnswer, ServerConnection
from .copies import copy, value_slices
from .protocol import RELEASED, RESERVATION, Alloc, Flag, Op, Status, pack_keys
from .segments import Segments
from .uses import Uses

# Plain ints for the per-key loops (an enum member compares slower).
_ALLOC_NEW = int(Alloc.NEW)
_ALLOC_PRESENT = int(Alloc.PRESENT)
_ALLOC_FAILED = int(Alloc.FAILED)


def run_starts(nruns) -> list[int]:
    """Where each value's runs begin in the flat runs array (first chunk,
    count pairs), given each value's run count; one more at the end."""
    starts = [0]
    for n in nruns:
        starts.append(starts[-1] + 2 * n)
    return starts


class Reservation:
    """Chunks the server holds for this client's next put: item i, of
    ``capacities[i]`` bytes, is the runs ``runs[starts[i]:starts[i + 1]]``
    (pairs of first chunk and count)."""

    __slots__ = ("lease_id", "epoch", "pid", "use_by", "capacities", "nruns", "runs", "starts")

    def __init__(self, lease_id: int, seg: Segments, nruns: array.array, runs: array.array) -> None:
        self.lease_id = lease_id
        self.epoch = seg.epoch
        self.pid = os.getpid()
        self.use_by = time.monotonic() + seg.reserve_use_s
        self.nruns = nruns
        self.runs = runs
        self.starts = run_starts(nruns)
        self.capacities = [sum(runs[j + 1] for j in range(start, end, 2)) * seg.chunk
                           for start, end in zip(self.starts, self.starts[1:])]

    @classmethod
    def from_reply(cls, frames: list[bytes], seg: Segments) -> "Reservation | None":
        """The reservation a COMMIT flagged ``RESERVE`` answered
        (its last three frames); None when the server made none."""
        if len(frames) < 3:
            return None
        (lease_id,) = RESERVATION.unpack(frames[-3])
        if not lease_id:
            return None
        return cls(lease_id, seg, array.array("I", frames[-2]), array.array("i", frames[-1]))

    def fits(self, sizes: array.array, seg: Segments) -> bool:
        """Whether a put of values of ``sizes`` may use it now."""
        return (self.epoch == seg.epoch and time.monotonic() < self.use_by and len(sizes) <= len(self.capacities)
                and all(0 <= size <= cap for size, cap in zip(sizes, self.capacities)))


class Writer:
    """The puts of one ``ShmStore``.  Thread-safe: a reservation is taken by
    one put at a time."""

    def __init__(self, conn: ServerConnection, uses: Uses, overwrite: bool) -> None:
        self._conn = conn
        self._uses = uses
        self.overwrite = overwrite
        self._lock = threading.Lock()
        self._held: Reservation | None = None
        #: Puts made with one round trip (into a reservation), for ``stats``.
        self.reserved_puts = 0

    def _take(self) -> Reservation | None:
        with self._lock:
            held, self._held = self._held, None
        # After a fork the parent's reservation is the parent's.
        return held if held is not None and held.pid == os.getpid() else None

    def _hold(self, out: list[bytes], seg: Segments, deadline: float) -> None:
        new = Reservation.from_reply(out, seg)
        if new is None:
            return
        with self._lock:
            extra, self._held = self._held, new
        if extra is not None and extra.pid == os.getpid():
            self._abort(extra.lease_id, extra.epoch, deadline)    # another thread's put got one meanwhile

    def _abort(self, lease_id: int, epoch: int, deadline: float) -> None:
        """Give a lease or reservation back; one not given back is reclaimed
        after the lease timeout, or once this process is gone."""
        try:
            self._conn.call(Op.ABORT, arg=lease_id, epoch=epoch, deadline=deadline)
        except (NoAnswer, StoreError):
            pass

    def close(self, deadline: float) -> None:
        """Give the reservation back (at close)."""
        held = self._take()
        if held is not None:
            self._abort(held.lease_id, held.epoch, deadline)

    def write(self, keys: Sequence[bytes], srcs: list[list], before_value: Callable[[int], object] | None = None
              ) -> list[bool]:
        """Put the values of ``srcs`` (each a list of parts, in order) under
        ``keys``, copying them straight into the segment (``before_value(i)``
        just before value i's copy).  Which values are stored."""
        if not keys:
            return []
        sizes = array.array("q", [sum(p.nbytes for p in value_parts) for value_parts in srcs])
        held = self._take()
        seg = self._conn.mapped()
        if held is not None and seg is not None and held.fits(sizes, seg):
            return self._put_reserved(held, seg, keys, srcs, sizes, before_value)
        return self._put_allocated(keys, srcs, sizes, before_value, held)

    def _put_flags(self) -> tuple[int, list[bytes]]:
        """The flags of a put's ALLOC or DECLARE, and the frames of this
        client's gets since its last request, to ride along with it so
        that the chunks it evicts are the least recently used."""
        flags = int(Flag.OVERWRITE) if self.overwrite else 0
        uses = self._uses.take(with_late=False)
        if uses is None:
            return flags, []
        return flags | Flag.TOUCHED, Uses.frames(*uses[:3])

    def _reserve_frames(self, seg: Segments, sizes: array.array) -> tuple[int, list[bytes]]:
        if not seg.reserve_use_s:
            return 0, []
        return int(Flag.RESERVE), [sizes.tobytes()]

    def _put_allocated(self, keys, srcs, sizes, before_value, held: Reservation | None) -> list[bool]:
        key_len, key_frames = pack_keys(keys)
        flags, touch = self._put_flags()
        frames = [*key_frames, sizes.tobytes(), *touch]
        if held is not None:
            # Given back here, not by a request of its own; the server
            # checks the epoch, so a retry under a newer server frees nothing.
            flags |= Flag.RELEASE
            frames.append(RELEASED.pack(held.epoch, held.lease_id))
        # One deadline for the waits of both requests; the copy between them
        # is not waiting on the server, so it extends the deadline.
        deadline = self._conn.deadline()
        try:
            seg, _status, out = self._conn.request(Op.ALLOC, frames, key_len=key_len, flags=flags,
                                                   arg=os.getpid(), deadline=deadline)
        except StoreUnavailableError:
            # put never raises into the hot path for a medium that is gone;
            # the next call reconnects (or restarts the server).
            return [False] * len(keys)
        lease_id = int.from_bytes(out[0], "little", signed=True)
        status = out[1]
        nruns = array.array("I", out[2])
        runs = array.array("i", out[3])
        result = [s == _ALLOC_PRESENT for s in status]
        if not lease_id:
            return result
        starts = run_starts(nruns)
        todo = [(i, starts[k], starts[k + 1]) for k, i in enumerate(i for i, st in enumerate(status)
                                                                      if st == _ALLOC_NEW)]
        deadline = self._copy(seg, lease_id, todo, runs, srcs, sizes, before_value, deadline)
        return self._commit(seg, lease_id, sizes, deadline, [st != _ALLOC_FAILED for st in status], result)

    def _put_reserved(self, held: Reservation, seg: Segments, keys, srcs, sizes, before_value) -> list[bool]:
        deadline = self._conn.deadline()
        key_len, key_frames = pack_keys(keys)
        flags, touch = self._put_flags()
        try:
            # Not answered: the server names the keys while the values are
            # copied, and answers the COMMIT after it.
            self._conn.call(Op.DECLARE, [*key_frames, sizes.tobytes(), *touch], key_len=key_len, flags=flags,
                            arg=held.lease_id, epoch=held.epoch, deadline=deadline)
        except (NoAnswer, StoreError):
            return [False] * len(keys)
        todo = [(i, held.starts[i], held.starts[i + 1]) for i in range(len(keys))]
        deadline = self._copy(seg, held.lease_id, todo, held.runs, srcs, sizes, before_value, deadline)
        stored = [True] * len(keys)
        result = self._commit(seg, held.lease_id, sizes, deadline, stored, [False] * len(keys))
        if result is stored:
            self.reserved_puts += 1
        return result

    def _commit(self, seg: Segments, lease_id: int, sizes: array.array, deadline: float, stored: list[bool],
                otherwise: list[bool]) -> list[bool]:
        """COMMIT the lease, asking for the next reservation: ``stored``
        once it is committed, else ``otherwise``."""
        flags, reserve = self._reserve_frames(seg, sizes)
        try:
            _seg, status, out = self._conn.request(Op.COMMIT, reserve, flags=flags, arg=lease_id,
                                                   deadline=deadline, epoch=seg.epoch)
        except StoreUnavailableError:
            return otherwise
        if status != Status.OK:
            return otherwise
        self._hold(out, seg, deadline)
        return stored

    def _copy(self, seg: Segments, lease_id: int, todo: list[tuple[int, int, int]], runs: array.array,
              srcs, sizes, before_value, deadline: float) -> float:
        """Copy value i into ``runs[start:end]`` for each (i, start, end) of
        ``todo``; the deadline, moved on by the time the copies took.  A
        copy that raises gives the chunks back (ABORT) and re-raises."""
        data = seg.data
        chunk = seg.chunk
        copy_started = time.monotonic()
        try:
            for i, start, end in todo:
                src = srcs[i]
                if before_value is not None:
                    before_value(i)
                if end - start == 2:
                    off = runs[start] * chunk
                    for part in src:
                        copy(data[off:off + part.nbytes], part)
                        off += part.nbytes
                else:
                    copy_into_parts(value_slices(data, chunk, runs, start, end, sizes[i]), src, copy)
        except BaseException:
            self._abort(lease_id, seg.epoch, deadline + time.monotonic() - copy_started)
            raise
        return deadline + time.monotonic() - copy_started
