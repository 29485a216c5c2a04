"""Block files: one block's file format, and publishing, reading, retiring
and sweeping those files.

Format.  Each file holds ``value | key | value length | key length | magic``.
The fixed trailer sits after the value and the key so that the value starts
at offset 0: reads from the page cache into page-aligned buffers stay
aligned.  A read checks all of it and that the file's size is exactly the
sum, so a hash collision, a truncated or an extended file is never returned
as valid.

Publishing.  A block is written to ``<name>.<pid>.<n>.tmp`` next to its final
name and renamed over it, so readers see a whole file or none, also when the
writer is killed.  Files are immutable once published: an open reader keeps
its whole file even when the block is evicted or replaced under it.  A file
is removed by first renaming it to a temp name (``retire``), so that a
process killed before the unlink leaves a temp file, which ``scan`` sweeps
once its pid is gone or it is older than ten minutes.

This module owns the files and nothing else.  It must not touch the index,
count hits or decide what to evict or remove: a read says what it found
(``ReadStatus``) and the store decides what that means for the index.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import errno
import itertools
import os
import struct
import time
from typing import Iterator

from ..process import pid_alive
from .layout import SHARDS, block_name, block_path, is_block_name

_MAGIC = b"UCMBLK\x00\x01"
# The fixed end of a block file: value length, key length, magic.
_TRAILER = struct.Struct("<QI8s")
#: The most buffers ``read_into`` fills with one read (the system's
#: IOV_MAX is 1024; two go to the trailer).
MAX_PARTS = 1000
_STALE_TMP_SECONDS = 600.0


class ReadStatus(enum.IntEnum):
    """What reading one key's block file found."""

    HIT = 0       # the whole value, under this key, of the expected size
    MISS = 1      # nothing usable, and nothing to repair: a sound block of another size, a colliding key, an I/O error
    GONE = 2      # no file under the key's name
    CORRUPT = 3   # a damaged file: remove it (and only it: ``inode``)


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRead:
    status: ReadStatus
    inode: int | None = None      # of the damaged file, for a CORRUPT read
    value: bytes | None = None    # for a HIT of ``read``


@dataclasses.dataclass(frozen=True, slots=True)
class BlockInfo:
    """What a sound block file says about itself."""

    key: bytes
    nbytes: int                   # the value's size
    inode: int
    mtime_ns: int


class BlockFiles:
    """The block files under one store directory.  Thread-safe: every
    method works on its own file descriptors, and names are unique per
    process and call."""

    def __init__(self, root: str, *, fsync: bool = False) -> None:
        self.root = root
        self.fsync = fsync
        self._counter = itertools.count()

    def path(self, key: bytes) -> str:
        return block_path(self.root, block_name(key))

    def exists(self, key: bytes) -> bool:
        return os.path.exists(self.path(key))

    def temp_path(self, path: str) -> str:
        """A name next to ``path`` that no other writer uses, and that
        ``scan`` sweeps once this process is gone."""
        return f"{path}.{os.getpid()}.{next(self._counter)}.tmp"

    def check_writable(self) -> None:
        """Raise ``OSError`` unless a file can be created in the root."""
        probe = self.temp_path(os.path.join(self.root, ".probe"))
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        os.unlink(probe)

    def make_shards(self) -> None:
        for shard in SHARDS:
            os.makedirs(os.path.join(self.root, shard), exist_ok=True)

    # ------------------------------------------------------------------ writing

    def publish(self, key: bytes, value: memoryview) -> int | None:
        """Write one block and rename it into place; its inode, or None
        where it could not be written (nothing is left behind then)."""
        path = self.path(key)
        tmp = self.temp_path(path)
        trailer = key + _TRAILER.pack(value.nbytes, len(key), _MAGIC)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileNotFoundError:
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except OSError:
                return None
        except OSError:
            return None
        try:
            try:
                pending = [value, memoryview(trailer)]
                total = value.nbytes + len(trailer)
                done = 0
                while done < total:
                    n = os.writev(fd, pending)
                    if n <= 0:
                        raise OSError(errno.EIO, "short write")
                    done += n
                    if done < total:
                        pending = _advance(pending, n)
                if self.fsync:
                    os.fsync(fd)
                inode = os.fstat(fd).st_ino
            finally:
                os.close(fd)
            os.rename(tmp, path)
            if self.fsync:
                dir_fd = os.open(os.path.dirname(path), os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
            return inode
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return None

    def retire(self, key: bytes, inode: int | None = None) -> str | None:
        """Move a key's block file out of its name, to a temp name to unlink
        later (``unlink_all``); None where there was nothing to move.  With
        ``inode``, only if the name still holds that file."""
        path = self.path(key)
        tmp = self.temp_path(path)
        try:
            if inode is not None and os.stat(path).st_ino != inode:
                return None
            os.rename(path, tmp)
        except OSError:
            return None
        return tmp

    @staticmethod
    def unlink_all(paths: list[str | None]) -> None:
        for path in paths:
            if path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(path)

    def unlink(self, key: bytes) -> None:
        """Remove a key's file at once (no index to keep in step with)."""
        with contextlib.suppress(OSError):
            os.unlink(self.path(key))

    # ------------------------------------------------------------------ reading

    def read_into(self, key: bytes, views: list[memoryview]) -> BlockRead:
        """Read one block straight into ``views``, filled in order (at most
        ``MAX_PARTS``).  One read where the file is what the buffers expect;
        anything else is judged by the file's own trailer."""
        try:
            fd = os.open(self.path(key), os.O_RDONLY)
        except OSError:
            return BlockRead(ReadStatus.GONE)
        try:
            trailer = bytearray(len(key) + _TRAILER.size)
            extra = bytearray(1)
            total = sum(v.nbytes for v in views)
            n = os.preadv(fd, [*views, trailer, extra], 0)
            if n == total + len(trailer):
                nbytes, key_len, magic = _TRAILER.unpack_from(trailer, len(key))
                if magic == _MAGIC and nbytes == total and key_len == len(key) \
                        and trailer[:len(key)] == key:
                    return BlockRead(ReadStatus.HIT)
            return _judge(fd, key)
        except OSError:
            return BlockRead(ReadStatus.MISS)
        finally:
            os.close(fd)

    def read(self, key: bytes) -> BlockRead:
        """Read one block's whole value."""
        try:
            fd = os.open(self.path(key), os.O_RDONLY)
        except OSError:
            return BlockRead(ReadStatus.GONE)
        try:
            found = _inspect(fd)
            if found is None or found.key != key:
                return _judge(fd, key)
            value = os.pread(fd, found.nbytes, 0) if found.nbytes else b""
            if len(value) != found.nbytes:
                return BlockRead(ReadStatus.CORRUPT, found.inode)
            return BlockRead(ReadStatus.HIT, value=value)
        except OSError:
            return BlockRead(ReadStatus.MISS)
        finally:
            os.close(fd)

    def peek(self, key: bytes, nbytes: int | None) -> tuple[int, bytes] | None:
        """(value size, its first ``nbytes`` bytes) of a sound block under
        ``key``, else None; a damaged file is left alone."""
        try:
            fd = os.open(self.path(key), os.O_RDONLY)
        except OSError:
            return None
        try:
            found = _inspect(fd)
            if found is None or found.key != key:
                return None
            want = found.nbytes if nbytes is None else min(nbytes, found.nbytes)
            data = os.pread(fd, want, 0) if want else b""
            return (found.nbytes, data) if len(data) == want else None
        except OSError:
            return None
        finally:
            os.close(fd)

    def block_info(self, path: str, name: str) -> BlockInfo | None:
        """What the file at ``path`` says about itself, if it is a sound
        block stored under its own ``name``."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            found = _inspect(fd)
        except OSError:
            return None
        finally:
            os.close(fd)
        if found is None or block_name(found.key) != name:
            return None
        return found

    # ------------------------------------------------------------------ the directory

    def scan(self) -> dict[str, str]:
        """Sweep dead writers' temp files; the published block files by name
        (name -> path), whatever their content.  A missing shard directory
        holds no blocks."""
        now = time.time()
        with os.scandir(self.root) as entries:
            for entry in entries:
                if entry.name.endswith(".tmp"):
                    _sweep_tmp(entry, now)
        found: dict[str, str] = {}
        for shard, entry in self._shard_entries():
            if entry.name.endswith(".tmp"):
                _sweep_tmp(entry, now)
            elif is_block_name(entry.name, shard):
                found[entry.name] = entry.path
        return found

    def keys_on_disk(self) -> list[bytes]:
        """Every sound block file's key, sorted, read from the files; sweeps
        nothing."""
        keys = []
        for shard, entry in self._shard_entries():
            if is_block_name(entry.name, shard):
                found = self.block_info(entry.path, entry.name)
                if found is not None:
                    keys.append(found.key)
        return sorted(keys)

    def _shard_entries(self) -> Iterator[tuple[str, os.DirEntry]]:
        for shard in SHARDS:
            try:
                entries = os.scandir(os.path.join(self.root, shard))
            except FileNotFoundError:
                continue
            with entries:
                for entry in entries:
                    yield shard, entry


def _inspect(fd: int) -> BlockInfo | None:
    """The file's own trailer, or None where the file is not a sound block."""
    st = os.fstat(fd)
    if st.st_size < _TRAILER.size:
        return None
    tail = os.pread(fd, _TRAILER.size, st.st_size - _TRAILER.size)
    if len(tail) != _TRAILER.size:
        return None
    nbytes, key_len, magic = _TRAILER.unpack(tail)
    if magic != _MAGIC or not key_len or nbytes + key_len + _TRAILER.size != st.st_size:
        return None
    key = os.pread(fd, key_len, nbytes)
    if len(key) != key_len:
        return None
    return BlockInfo(key, nbytes, st.st_ino, st.st_mtime_ns)


def _judge(fd: int, key: bytes) -> BlockRead:
    """Why a block could not be read as expected: a sound block of another
    size (a miss), another key whose name collides (a miss that leaves that
    block alone, in theory only), or a damaged file."""
    try:
        found = _inspect(fd)
        if found is not None:
            if found.key == key or block_name(found.key) == block_name(key):
                return BlockRead(ReadStatus.MISS)
        return BlockRead(ReadStatus.CORRUPT, os.fstat(fd).st_ino)
    except OSError:
        return BlockRead(ReadStatus.MISS)


def _sweep_tmp(entry: os.DirEntry, now: float) -> None:
    parts = entry.name.split(".")
    try:
        pid = int(parts[-3])
    except (IndexError, ValueError):
        pid = -1
    try:
        old = now - entry.stat(follow_symlinks=False).st_mtime > _STALE_TMP_SECONDS
    except OSError:
        return
    if pid <= 0 or old or not pid_alive(pid):
        with contextlib.suppress(OSError):
            os.unlink(entry.path)


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    out = []
    for view in views:
        if n >= view.nbytes:
            n -= view.nbytes
            continue
        out.append(view[n:])
        n = 0
    return out
