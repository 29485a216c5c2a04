"""The client of an ``shm://NAME`` store: ``ShmStore``, the KVStore engines use.

The values live in a data segment under /dev/shm that every client maps; a
small index server (``server``, one per NAME, started on demand and detached
so it outlives the process that started it) owns the LRU index and hands out
chunks of the segment.  This module owns the store's operations: it parses
the URL, hands puts to its ``puts.Writer``, packs the requests of get,
lookups and deletes, answers lookups from the server's key table
(``keytable``) and finds the values of gets from its published locations
(``locations``) when it can, telling the server of those uses later in one
message (``Op.TOUCH``, or along with the next put, so that LRU order holds
for its own puts; ``uses`` keeps what is owed), copies values from the
segment into the caller's buffers (once, with no intermediate buffer;
``copies``), and checks the chunk generations after each read so that a
value overwritten or evicted during the copy is a miss, never a wrong
value.  It must not keep the index or decide evictions (the server's),
define the wire format (``protocol``) or the file layout (``paths``), nor
handle sockets, deadlines, reconnects or server starts (``connection``,
``launch``) or map segments (``segments``).

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
* ``cpus`` (default: any): the CPUs a server this client starts runs on,
  as ``taskset -c`` writes them (``3``, ``2-3``).  Given a CPU the engines
  leave free, the server no longer waits for the CPU of the writer that
  woke it.
* ``runtime_dir``: where the control socket and lock files go.  It must be
  this user's and writable by no one else (``paths.check_rundir``).
"""

from __future__ import annotations

import array
import json
import os
import time
from typing import Callable, Iterator, Sequence

import numpy as np

from ..base import (Buffer, KVStore, OpenMode, StoreError, StoreOpenError, StoreStats, StoreUnavailableError,
                    byte_view, copy_into_parts)
from ..process import pid_alive
from ..urls import mask_password, parse_bool, parse_cpus, parse_seconds, parse_size, query_options, split_store_url
from . import admin
from .connection import NoAnswer, ServerConnection
from .copies import copy, copy_run_into_parts, value_slices
from .keytable import fingerprints
from .launch import ServerSettings
from .paths import Paths, name_arg, valid_name
from .protocol import DEFAULT_CHUNK_NBYTES, DEFAULT_LEASE_TIMEOUT_S, Flag, Op, pack_keys, unpack_keys
from .puts import Writer
from .segments import Segments
from .uses import Uses

# URL option -> (keyword of ShmStore, how its text is read).
_OPTIONS = {
    "capacity": ("capacity_nbytes", parse_size),
    "chunk": ("chunk_nbytes", parse_size),
    "server": ("server", lambda text, *, url, name: text.strip().lower()),
    "idle_timeout": ("idle_timeout_s", parse_seconds),
    "lease_timeout": ("lease_timeout_s", parse_seconds),
    "timeout": ("timeout_s", parse_seconds),
    "overwrite": ("overwrite", parse_bool),
    "prefault": ("prefault", parse_bool),
    "runtime_dir": ("runtime_dir", lambda text, *, url, name: text),
    "cpus": ("cpus", parse_cpus),
}

#: How long closing a store waits to send its pending uses and give back
#: its reservation.
_CLOSE_WAIT_S = 0.5


class ShmStore(KVStore):
    """Client of one ``shm://NAME`` store.  Thread-safe: each thread talks to
    the server over its own socket; copies run in parallel."""

    def __init__(self, name: str, *, capacity_nbytes: int = 1 << 30,
                 chunk_nbytes: int = DEFAULT_CHUNK_NBYTES, server: str = "embedded",
                 idle_timeout_s: float | None = None, lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S,
                 timeout_s: float = 5.0, overwrite: bool = False, prefault: bool = True,
                 runtime_dir: str | None = None, url: str | None = None,
                 open_mode: OpenMode | str = OpenMode.SERVE, cpus: tuple[int, ...] | None = None) -> None:
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
        self.idle_timeout_s = idle_timeout_s
        self.lease_timeout_s = lease_timeout_s
        self.timeout_s = timeout_s
        self.prefault = prefault
        self.paths = Paths(name, os.path.abspath(runtime_dir) if runtime_dir else None)
        if len(self.paths.socket.encode()) > 100:
            raise StoreOpenError(
                f"store '{self.url}': the control socket path {self.paths.socket!r} is too long for a "
                f"unix socket; use a shorter name or runtime_dir")
        settings = ServerSettings(name=name, capacity_nbytes=capacity_nbytes, chunk_nbytes=chunk_nbytes,
                                  idle_timeout_s=idle_timeout_s, lease_timeout_s=lease_timeout_s,
                                  prefault=prefault, cpus=cpus)
        self._conn = ServerConnection(self.url, self.paths, settings, timeout_s=timeout_s,
                                      open_mode=self.open_mode, server_mode=server)
        # Gets answered from the published locations, and reads found torn
        # or mis-sized, not yet told to the server.
        self._uses = Uses()
        self._writer = Writer(self._conn, self._uses, overwrite)
        try:
            self._conn.connect()
        except StoreOpenError:
            self.close()
            raise
        except (StoreUnavailableError, OSError) as exc:
            self.close()
            raise StoreOpenError(f"store '{self.url}': {exc}") from exc

    @property
    def overwrite(self) -> bool:
        """Whether a put of a stored key replaces its value (the writer's setting)."""
        return self._writer.overwrite

    @overwrite.setter
    def overwrite(self, value: bool) -> None:
        self._writer.overwrite = value

    @classmethod
    def from_url(cls, url: str, mode: OpenMode | str = OpenMode.SERVE) -> "ShmStore":
        """Open the store an ``shm://`` URL names.  ``mode``: ``OpenMode.SERVE``
        starts a server as the URL's ``server`` option says; ``INSPECT`` never
        does, and raises ``ShmServerNotRunning`` when none runs."""
        masked = mask_password(url)
        parts = split_store_url(url, ("shm",), credentials=False, example="shm://NAME?capacity=4GiB")
        name = parts.netloc
        if parts.path not in ("", "/") or not name:
            raise StoreOpenError(f"store '{masked}': write it as shm://NAME?capacity=4GiB (NAME: letters, "
                                 f"digits, '-', '_', '.')")
        opts = query_options(url, set(_OPTIONS))
        kwargs: dict[str, object] = {}
        for option, (keyword, parse) in _OPTIONS.items():
            if option in opts:
                kwargs[keyword] = parse(opts[option], url=url, name=option)
        return cls(name, url=url, open_mode=mode, **kwargs)  # type: ignore[arg-type]

    # ------------------------------------------------------------ requests

    def _request(self, op: int, frames: Sequence[bytes] = (), *, key_len: int = 0, flags: int = 0,
                 arg: int = 0, bound: bool = True, deadline: float | None = None, epoch: int | None = None
                 ) -> tuple[Segments, int, list[bytes]]:
        """One request to the server (``ServerConnection.request``)."""
        return self._conn.request(op, frames, key_len=key_len, flags=flags, arg=arg, bound=bound,
                                  deadline=deadline, epoch=epoch)

    @property
    def _pid(self) -> int:
        """The process this store's sockets belong to (a writer's lease names it)."""
        return self._conn.pid

    # ------------------------------------------------------------ KVStore

    def put(self, keys: Sequence[bytes], values: Sequence[bytes | Buffer]) -> list[bool]:
        if len(values) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        return self._writer.write(keys, [[byte_view(v, writable=False)] for v in values])

    writes_from_parts = True

    def put_parts(self, keys: Sequence[bytes], parts: Sequence[Sequence[Buffer]],
                  before_value: Callable[[int], object] | None = None) -> list[bool]:
        if len(parts) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(parts)} lists of parts")
        return self._writer.write(keys, [[byte_view(p, writable=False) for p in value_parts]
                                         for value_parts in parts], before_value)

    def _lookup(self, keys: Sequence[bytes], flags: int = 0):
        """Where each key's value lives: (segments, sizes (-1: miss),
        first-chunk generations, first chunks, run counts, runs).  For a
        counted get, from the published locations where they prove it, and
        from the server for the other keys."""
        if not flags & Flag.NO_TOUCH:
            local = self._locate(keys)
            if local is not None:
                return local
        return self._ask(keys, flags)

    def _ask(self, keys: Sequence[bytes], flags: int = 0):
        """``_lookup``'s answer from the server."""
        key_len, key_frames = pack_keys(keys)
        late = 0
        if not flags & Flag.NO_TOUCH:
            late = self._uses.take_late()
        seg, _status, out = self._request(Op.GET, key_frames, key_len=key_len, arg=late, flags=flags)
        sizes = array.array("q", out[0])
        gens = np.frombuffer(out[1], dtype=np.uint64)
        firsts = np.frombuffer(out[2], dtype=np.int32)
        nruns = array.array("I", out[3])
        runs = array.array("i", out[4])
        return seg, sizes, gens, firsts, nruns, runs

    def _locate(self, keys: Sequence[bytes]):
        """``_lookup``'s answer from the published tables, asking the
        server only for the keys they cannot prove now; None when they
        cannot answer at all (none published, being rebuilt, server gone)."""
        seg = self._conn.mapped()
        if seg is None or seg.where is None or not pid_alive(seg.server_pid):
            return None
        try:
            fps = fingerprints(keys)
        except (TypeError, ValueError):
            return None     # not bytes, or empty: the request path says what is wrong
        slots = seg.keys.find(fps)
        if slots is None:
            return None
        hit = np.flatnonzero(slots >= 0)
        hit_firsts, hit_sizes, hit_gens, proven = seg.where.locate(
            keys if len(hit) == len(keys) else [keys[i] for i in hit], slots[hit], seg.gen, seg.chunk)
        n = len(keys)
        sizes = np.full(n, -1, np.int64)
        gens = np.zeros(n, np.uint64)
        firsts = np.full(n, -1, np.int32)
        found = hit[proven]
        sizes[found] = hit_sizes[proven]
        gens[found] = hit_gens[proven]
        firsts[found] = hit_firsts[proven]
        asked = hit[~proven]
        if self._uses.read_locally([keys[i] for i in found], n - len(asked)):
            self._send_uses()
        if not len(asked):
            runs = np.empty(2 * len(found), np.int64)
            runs[0::2] = firsts[found]
            runs[1::2] = -(-sizes[found] // seg.chunk)
            return seg, sizes.tolist(), gens, firsts, (sizes >= 0).astype(np.int64).tolist(), runs.tolist()
        return self._merge(seg, keys, sizes, gens, firsts, asked)

    def _merge(self, seg: Segments, keys: Sequence[bytes], sizes: np.ndarray, gens: np.ndarray,
               firsts: np.ndarray, asked: np.ndarray):
        """``_lookup``'s answer from locations found for some keys and the
        server's answer for those at ``asked``."""
        asked_seg, a_sizes, a_gens, a_firsts, a_nruns, a_runs = self._ask([keys[i] for i in asked])
        if asked_seg is not seg:
            return self._ask(keys)       # the server was replaced meanwhile: none of the locations stands
        sizes[asked] = a_sizes
        gens[asked] = a_gens
        firsts[asked] = a_firsts
        nruns = (sizes >= 0).astype(np.int64)
        nruns[asked] = a_nruns
        from_server = dict(zip(asked.tolist(), range(len(asked))))
        runs: list[int] = []
        pos = 0
        chunk = seg.chunk
        for i, size in enumerate(sizes.tolist()):
            j = from_server.get(i)
            if j is not None:
                runs += a_runs[pos:pos + 2 * a_nruns[j]]
                pos += 2 * a_nruns[j]
            elif size >= 0:
                runs += (int(firsts[i]), -(-size // chunk))
        return seg, sizes.tolist(), gens, firsts, nruns.tolist(), runs

    def _send_uses(self, deadline: float | None = None) -> None:
        """Tell the server of the pending uses (best effort: uses of a
        server that does not answer are dropped, as a cache may)."""
        uses = self._uses.take(with_late=True)
        if uses is None:
            return
        try:
            self._request(Op.TOUCH, Uses.frames(*uses[:3]), arg=uses[3], bound=False, deadline=deadline)
        except StoreUnavailableError:
            pass

    @staticmethod
    def _unchanged(seg: Segments, gens: np.ndarray, firsts: np.ndarray) -> list[bool]:
        # A value's chunks are freed together, and freeing bumps every
        # chunk's generation, so the first chunk's generation tells whether
        # any chunk of the value was reused since the lookup.
        current = seg.gen[np.maximum(firsts, 0)]
        return ((current == gens) | (firsts < 0)).tolist()

    reads_into_parts = True

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        if len(buffers) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        return self._read_into(keys, [[byte_view(b, writable=True)] for b in buffers])

    def get_into_parts(self, keys: Sequence[bytes], parts: Sequence[Sequence[Buffer]],
                       on_value: Callable[[int], object] | None = None) -> list[bool]:
        if len(parts) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(parts)} lists of parts")
        return self._read_into(keys, [[byte_view(p, writable=True) for p in value_parts] for value_parts in parts],
                               on_value)

    def _read_into(self, keys: Sequence[bytes], dsts: list[list[memoryview]],
                   on_value: Callable[[int], object] | None = None) -> list[bool]:
        """Copy each key's value out of its chunks into its buffers; with
        ``on_value``, check each value's generation right after its copy and
        call ``on_value(i)`` for the whole ones before copying the next."""
        if not keys:
            return []
        seg, sizes, gens, firsts, nruns, runs = self._lookup(keys)
        data = seg.data
        chunk = seg.chunk
        copied = [False] * len(keys)
        late = torn = 0
        pos = 0
        for i, size in enumerate(sizes):
            if size < 0:
                continue
            end = pos + 2 * nruns[i]
            dst = dsts[i]
            if sum(d.nbytes for d in dst) != size:
                late += 1
                pos = end
                continue
            if nruns[i] == 1 and len(dst) == 1:
                off = runs[pos] * chunk
                copy(dst[0], data[off:off + size])
            elif nruns[i] == 1:
                copy_run_into_parts(dst, data, runs[pos] * chunk)
            else:
                copy_into_parts(dst, value_slices(data, chunk, runs, pos, end, size), copy)
            pos = end
            if on_value is None:
                copied[i] = True
            elif firsts[i] < 0 or seg.gen[firsts[i]] == gens[i]:
                copied[i] = True        # whole when checked: later reuse of its chunks cannot change the copy
                on_value(i)
            else:
                torn += 1
        if on_value is None:
            result = [c and u for c, u in zip(copied, self._unchanged(seg, gens, firsts))]
            torn = copied.count(True) - result.count(True)
        else:
            result = copied
        self._uses.missed_late(late + torn, torn)
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
                values[i] = b"".join(value_slices(data, chunk, runs, pos, end, size))
            pos = end
        torn = 0
        for i, unchanged in enumerate(self._unchanged(seg, gens, firsts)):
            if not unchanged and values[i] is not None:
                values[i] = None
                torn += 1
        self._uses.missed_late(torn, torn)
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
            out[i] = (size, b"".join(value_slices(data, chunk, runs, pos, end, want)))
            pos = end
        for i, unchanged in enumerate(self._unchanged(seg, gens, firsts)):
            if not unchanged:
                out[i] = None
        return out

    def iter_keys(self, batch: int = 1000) -> Iterator[list[bytes]]:
        """A snapshot of the server's index, least recently used first."""
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        self._send_uses()
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

    def _published(self, keys: Sequence[bytes]) -> np.ndarray | None:
        """Which keys are stored, from the server's key table, with no
        request; None when the table cannot tell now (none published, being
        rebuilt, or its server gone): then ask."""
        seg = self._conn.mapped()
        table = seg.keys if seg is not None else None
        if table is None or not pid_alive(seg.server_pid):
            return None
        try:
            fps = fingerprints(keys)
        except (TypeError, ValueError):
            return None     # not bytes, or empty: the request path says what is wrong
        return table.lookup(fps)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        found = self._published(keys)
        if found is not None:
            return found.tolist()
        key_len, key_frames = pack_keys(keys)
        _seg, _status, out = self._request(Op.CONTAINS, key_frames, key_len=key_len, bound=False)
        return np.frombuffer(out[0], dtype=np.bool_).tolist()

    def prefix_len(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        found = self._published(keys)
        if found is not None:
            missing = np.flatnonzero(~found)
            return int(missing[0]) if missing.size else len(keys)
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
        self._send_uses()
        late = self._uses.take_late()
        torn = self._uses.torn
        _seg, _status, out = self._request(Op.STATS, arg=late, bound=False)
        info = json.loads(out[0])
        extra = {k: info[k] for k in ("epoch", "pid", "chunk_nbytes", "num_chunks", "free_chunks",
                                      "leased_chunks", "used_chunks", "num_leases", "uptime_s",
                                      "leases_reclaimed", "idle_timeout_s", "lease_timeout_s", "key_table_slots",
                                      "key_table_live", "key_table_used", "key_table_active", "reserved_chunks",
                                      "reservations", "reservations_refused") if k in info}
        extra["server_pid"] = extra.pop("pid", None)
        extra["torn_reads"] = torn
        extra["local_gets"] = self._uses.local_gets
        extra["reserved_puts"] = self._writer.reserved_puts
        extra["data_path"] = info.get("data_path")
        return StoreStats(url=self.url, kind="shm", num_blocks=info["num_blocks"], nbytes=info["nbytes"],
                          capacity_nbytes=info["capacity_nbytes"], num_evictions=info.get("evictions", 0),
                          num_puts=info.get("puts", 0), num_gets=info.get("gets", 0), num_hits=info.get("hits", 0),
                          num_misses=info.get("misses", 0), num_put_failures=info.get("put_failures", 0),
                          extra=extra)

    def shutdown_server(self, timeout_s: float = 10.0) -> bool:
        """Stop the server of this NAME (its blocks are gone) and close this
        client.  True if a server was running."""
        try:
            stopped = admin.stop_server(self.name, self.paths.rundir, timeout_s=timeout_s)
        finally:
            self.close()
        return stopped

    def close(self) -> None:
        seg = self._conn.mapped()
        if seg is not None and pid_alive(seg.server_pid):
            deadline = time.monotonic() + min(_CLOSE_WAIT_S, self.timeout_s)
            uses = self._uses.take(with_late=True) if self._uses.pending else None
            if uses is not None:
                try:
                    self._conn.call(Op.TOUCH, Uses.frames(*uses[:3]), arg=uses[3], deadline=deadline)
                except (NoAnswer, StoreError):
                    pass    # dropped: only LRU order and counters, of a server that does not answer
            self._writer.close(deadline)
        self._conn.close()
