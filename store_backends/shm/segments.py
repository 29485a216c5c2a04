"""Mapping the segments of an shm server epoch into a client.

Owns the one way a client maps shared memory: only the data, generation,
key-table and locations segments that ``paths`` defines for this NAME and the epoch
the server's HELLO announced, never through a symlink, only regular files
of this user at least as large as announced; and ``Segments``, the immutable snapshot of
one epoch's mappings that an operation keeps using while another thread
remaps.  Must not talk to the server (the HELLO is handed in), start one,
or read or write values: the store's operations (``client``) copy them.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat

import numpy as np

from . import locations
from .keytable import KeyTableReader, segment_nbytes
from .paths import Paths, name_arg


class BadServer(Exception):
    """The server's HELLO names segments a client must not map."""


def map_segment(named: object, expected: str, nbytes: int, *, writable: bool, populate: bool,
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
        raise BadServer(f"the shm server (pid {server_pid}) named the segment {named!r}, not {expected!r}"
                        f" as the protocol defines; refusing to map it. Stop that server (`ucm shm stop {name_arg}`)"
                        f" and check what runs as it")
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(expected, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BadServer(f"the shm segment {expected} is a symlink; refusing to map it. Remove it and stop "
                            f"the server (`ucm shm stop {name_arg}`)") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise BadServer(f"the shm segment {expected} is not a regular file of uid {os.geteuid()} (owner uid "
                            f"{info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o}); refusing to map it. Remove "
                            f"it and stop the server (`ucm shm stop {name_arg}`)")
        if info.st_size < nbytes:
            raise BadServer(f"the shm segment {expected} holds {info.st_size} bytes, fewer than the {nbytes} "
                            f"the shm server (pid {server_pid}) announced; refusing to map it. Stop the server "
                            f"(`ucm shm stop {name_arg}`)")
        mm_flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, nbytes, mm_flags, prot)
    finally:
        os.close(fd)


class Segments:
    """The mapped segments of one server epoch.  Immutable: an operation
    keeps using the snapshot it started with, also if another thread remaps."""

    __slots__ = ("epoch", "server_pid", "chunk", "num_chunks", "reserve_use_s", "data", "gen", "keys", "where",
                 "_maps")

    def __init__(self, info: dict, paths: Paths, populate: bool) -> None:
        try:
            self.epoch = int(info["epoch"])
            self.server_pid = int(info["pid"])
            self.chunk = int(info["chunk_nbytes"])
            self.num_chunks = int(info["num_chunks"])
            # How long a reservation may be used after its answer; 0: none are offered.
            self.reserve_use_s = max(0.0, float(info.get("reserve_use_s") or 0.0))
        except (KeyError, TypeError, ValueError) as exc:
            raise BadServer(f"the shm server's HELLO is malformed ({exc!r}); stop it "
                            f"(`ucm shm stop {name_arg(paths.name)}`)") from None
        if not (0 < self.epoch < 2**64 and self.chunk > 0 and 0 < self.num_chunks < 2**31):
            raise BadServer(f"the shm server's HELLO is malformed (epoch {self.epoch}, chunk {self.chunk}, "
                            f"{self.num_chunks} chunks); stop it (`ucm shm stop {name_arg(paths.name)}`)")
        data_mm = map_segment(info.get("data_path"), paths.segment(self.epoch, "data"),
                              self.chunk * self.num_chunks, writable=True, populate=populate,
                              server_pid=self.server_pid, name_arg=name_arg(paths.name))
        try:
            gen_mm = map_segment(info.get("gen_path"), paths.segment(self.epoch, "gen"), self.num_chunks * 8,
                                 writable=False, populate=False, server_pid=self.server_pid,
                                 name_arg=name_arg(paths.name))
        except BaseException:
            data_mm.close()
            raise
        self._maps = (data_mm, gen_mm)
        self.keys: KeyTableReader | None = None
        slots = info.get("key_table_slots") or 0
        if info.get("keys_path") is not None and isinstance(slots, int) and 0 < slots < 2**40:
            try:
                keys_mm = map_segment(info["keys_path"], paths.segment(self.epoch, "keys"), segment_nbytes(slots),
                                      writable=False, populate=False, server_pid=self.server_pid,
                                      name_arg=name_arg(paths.name))
            except BaseException:
                data_mm.close()
                gen_mm.close()
                raise
            self._maps += (keys_mm,)
            try:
                self.keys = KeyTableReader(keys_mm, slots)
            except ValueError as exc:
                self.release()
                raise BadServer(f"the shm server's key table is malformed ({exc}); stop it "
                                f"(`ucm shm stop {name_arg(paths.name)}`)") from None
        self.where: locations.LocationReader | None = None
        if self.keys is not None and info.get("where_path") is not None:
            self._map_locations(info, paths, slots)
        self.data = memoryview(data_mm)
        self.gen = np.frombuffer(gen_mm, dtype=np.uint64)

    def _map_locations(self, info: dict, paths: Paths, slots: int) -> None:
        try:
            where_mm = map_segment(info["where_path"], paths.segment(self.epoch, "where"),
                                   locations.segment_nbytes(slots, self.num_chunks), writable=False,
                                   populate=False, server_pid=self.server_pid, name_arg=name_arg(paths.name))
        except BaseException:
            self.release()
            raise
        self._maps += (where_mm,)
        try:
            self.where = locations.LocationReader(where_mm, slots, self.num_chunks)
        except ValueError as exc:
            self.release()
            raise BadServer(f"the shm server's locations segment is malformed ({exc}); stop it "
                            f"(`ucm shm stop {name_arg(paths.name)}`)") from None

    def release(self) -> None:
        data = getattr(self, "data", None)
        if data is not None:
            data.release()
        self.gen = None
        self.keys = None
        self.where = None
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:
                pass  # a view is still alive somewhere; the GC unmaps it later
