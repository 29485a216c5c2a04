"""``DiskStore``: the ``disk://`` KVStore, composing the block files
(block_files.py) and the shared index (index.py) under one directory.

This module owns the URL, the open modes, the rules that keep the files and
the index true to each other under crashes and concurrent processes, the
capacity, the read-only mode of a full file system, and the store's
counters.  It must not know the block file format or SQL: those are the
other two modules'.  It knows nothing of what the bytes mean.

Files and index.  The rules:

* A block's file is renamed into place before its row is inserted, and a
  row is deleted before its file is retired (renamed to a temp name inside
  the same transaction, unlinked after commit).  So a killed process leaves
  at worst a published file without a row, which the next open adopts, a
  temp file, which the next open sweeps, or a row without a file, which the
  first read that misses it drops.  Nothing stays unaccounted.
* ``contains`` and ``prefix_len`` trust the index's key set: a file removed
  behind the store's back reads as present until a read misses it.
* At open, one process at a time (``open.lock``) checks the index (one that
  is missing, unreadable or of another schema version is rebuilt by
  scanning the block files), sweeps dead writers' temp files, adopts
  published files without a row and drops rows without a file.  Usage above
  the capacity (adopted files, or a capacity smaller than the last
  process's) is evicted then.

Open modes.  ``OpenMode.SERVE`` (the engine's) creates the directory and
keeps the store within its capacity.  ``OpenMode.INSPECT`` (an operator's)
opens only a directory that already is a disk store (``is_disk_store``) and
creates no directory; the URL's capacity is reported by ``stats()`` but not
enforced, so nothing is evicted.  Both check the index against the files as
above, and both read, list and delete.

A full file system.  SQLite cannot open a WAL index without room for its
shared-memory file, so a store whose file system is 100% full (ENOSPC or
EDQUOT on a small write) opens read-only instead of failing: the files are
the truth then.  Reads work as always; ``contains`` looks for the file; puts
return ``False``; ``delete`` removes files only (their rows are dropped at
the next open, as for any row without a file); ``iter_keys`` scans the
files.  ``stats().read_only`` says why.  Puts try the index again at most
every ``_FULL_RETRY_SECONDS``, so storing resumes once space is freed,
without a restart.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
import sqlite3
import threading
import time
import urllib.parse
from typing import Callable, Iterator, Sequence

from ..base import (Buffer, KVStore, OpenMode, StoreError, StoreOpenError, StoreStats, StoreUnavailableError,
                    byte_view, check_batch)
from ..urls import mask_password, parse_bool, parse_seconds, parse_size, query_options, split_store_url
from .block_files import MAX_PARTS, BlockFiles, BlockRead, ReadStatus
from .index import BlockIndex
from .layout import INDEX_FILE, LOCK_FILE, block_name, is_disk_store

_OPTIONS = {"capacity", "fsync", "touch_interval"}
_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# A write this large must fit for the index to open: SQLite's shared-memory
# file alone takes 32 KiB.
_SPACE_PROBE_NBYTES = 64 * 1024
_FULL_RETRY_SECONDS = 5.0

logger = logging.getLogger(__name__)


def _mount_point(path: str) -> str:
    path = os.path.realpath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


@dataclasses.dataclass(frozen=True, slots=True)
class _Published:
    """A block a put has published as a file, waiting for its index row."""

    position: int     # in the put's batch
    key: bytes
    nbytes: int       # the value's size
    inode: int        # of the published file: a withdrawal removes only that file


class DiskStore(KVStore):
    """Blocks as files under one directory, ``root`` (absolute); see the
    package docstring."""

    def __init__(self, root: str, *, capacity_nbytes: int | None = None, fsync: bool = False,
                 touch_interval: float = 1.0, url: str | None = None,
                 mode: OpenMode | str = OpenMode.SERVE) -> None:
        self.root = os.path.abspath(root)
        self.url = mask_password(url) if url else f"disk://{self.root}"
        self.mode = OpenMode(mode)
        self.capacity_nbytes = capacity_nbytes
        self.fsync = fsync
        self.touch_interval = touch_interval
        # What puts and opens evict down to: an inspecting operator must not
        # shrink the engines' store to the capacity their URL happens to say.
        self._limit_nbytes = capacity_nbytes if self.mode is OpenMode.SERVE else None
        self._lock = threading.RLock()
        self._files = BlockFiles(self.root, fsync=fsync)
        self._index = BlockIndex(self.root, fsync=fsync, touch_interval=touch_interval)
        self._closed = False
        self._counts = dict(puts=0, gets=0, hits=0, misses=0, put_failures=0, corrupt=0, evictions=0)
        self._last_index_try = 0.0
        self._open()

    # ------------------------------------------------------------------ opening

    @classmethod
    def from_url(cls, url: str, mode: OpenMode | str = OpenMode.SERVE) -> "DiskStore":
        shown = mask_password(url)
        parts = split_store_url(url, ("disk",), credentials=False, example="disk:///var/cache/ucm")
        if parts.netloc:
            raise StoreOpenError(
                f"store '{shown}': a disk URL takes an absolute path after three slashes, like "
                f"disk:///var/cache/ucm; {parts.netloc!r} reads as a host or a relative path")
        path = urllib.parse.unquote(parts.path)
        if not path or path == "/":
            raise StoreOpenError(
                f"store '{shown}' names no directory; write it like disk:///var/cache/ucm")
        if not os.path.isabs(path):
            raise StoreOpenError(f"store '{shown}': the path {path!r} is not absolute")
        if "\x00" in path:
            raise StoreOpenError(f"store '{shown}': the path contains a NUL byte")
        options = query_options(url, _OPTIONS)
        capacity = None
        if "capacity" in options:
            capacity = parse_size(options["capacity"], url=url, name="capacity")
            if capacity <= 0:
                raise StoreOpenError(f"store '{shown}': capacity must be more than 0 bytes")
        fsync = parse_bool(options.get("fsync", "false"), url=url, name="fsync")
        touch = parse_seconds(options.get("touch_interval", "1"), url=url, name="touch_interval")
        return cls(path, capacity_nbytes=capacity, fsync=fsync, touch_interval=touch, url=url, mode=mode)

    def _open_error(self, what: str, exc: BaseException | None = None) -> StoreOpenError:
        detail = f": {exc.strerror or exc}" if isinstance(exc, OSError) else (f": {exc}" if exc else "")
        return StoreOpenError(f"store '{self.url}': {what}{detail}")

    def _open(self) -> None:
        if self.mode is OpenMode.INSPECT:
            if not os.path.isdir(self.root):
                raise StoreOpenError(f"store '{self.url}': there is no directory {self.root!r}, "
                                     f"so nothing is stored there; check the path")
            if not is_disk_store(self.root):
                raise StoreOpenError(f"store '{self.url}': {self.root!r} is not a disk store "
                                     f"(it has no {INDEX_FILE}); check the path")
        else:
            try:
                os.makedirs(self.root, exist_ok=True)
            except OSError as exc:
                raise self._open_error(f"cannot create the directory {self.root!r}", exc) from exc
            if not os.path.isdir(self.root):
                raise self._open_error(f"{self.root!r} is not a directory")
        try:
            self._open_index()
        except StoreOpenError as exc:
            if not self._no_space_left():
                raise
            mount = _mount_point(self.root)
            self._index.unavailable = (
                f"no space left on device: the file system mounted at {mount} "
                f"is full, so the store's index cannot be written; its blocks are read, new blocks are not "
                f"stored until space is freed (free space there, `ucm store clear` this store, or give it a "
                f"capacity below the free space)")
            self._last_index_try = time.monotonic()
            logger.warning("store '%s' opened read-only: %s (%s)", self.url, self._index.unavailable, exc)

    def _no_space_left(self) -> bool:
        """Whether the file system refuses to grow a file, the way it
        refused SQLite (which reports only "disk I/O error" then)."""
        probe = self._files.temp_path(os.path.join(self.root, ".space"))
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            return exc.errno in _NO_SPACE_ERRNOS
        try:
            return os.write(fd, bytes(_SPACE_PROBE_NBYTES)) < _SPACE_PROBE_NBYTES
        except OSError as exc:
            return exc.errno in _NO_SPACE_ERRNOS
        finally:
            os.close(fd)
            self._files.unlink_all([probe])

    def _try_leave_read_only(self) -> bool:
        """Open the index again if space was freed; at most every
        ``_FULL_RETRY_SECONDS``.  Caller holds ``self._lock``."""
        now = time.monotonic()
        if now - self._last_index_try < _FULL_RETRY_SECONDS:
            return False
        self._last_index_try = now
        reason, self._index.unavailable = self._index.unavailable, None
        try:
            self._open_index()
        except StoreOpenError:
            self._index.unavailable = reason
            return False
        logger.warning("store '%s': the index can be written again; storing blocks again", self.url)
        return True

    def _open_index(self) -> None:
        """Check the directory, then open, check and reconcile the index;
        ``StoreOpenError`` on failure."""
        try:
            self._files.check_writable()
            if self.mode is OpenMode.SERVE:
                self._files.make_shards()
        except OSError as exc:
            raise self._open_error(f"the directory {self.root!r} is not writable", exc) from exc
        try:
            lock_fd = os.open(os.path.join(self.root, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise self._open_error("cannot create the lock file", exc) from exc
        try:
            # Only one process at a time checks, rebuilds and reconciles the
            # index with the files; the others wait here for a consistent one.
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            try:
                self._index.open()
                self._reconcile_with_files()
            except sqlite3.Error as exc:
                self._index.close_conn()
                raise self._open_error("cannot use the index", exc) from exc
            except OSError as exc:
                self._index.close_conn()
                raise self._open_error("cannot scan the block files", exc) from exc
        finally:
            os.close(lock_fd)

    def _reconcile_with_files(self) -> None:
        """Sweep dead writers' temp files, adopt published files that have no
        row (a writer killed between rename and insert, or a lost index) and
        drop rows whose file is gone."""
        index = self._index
        by_name = {block_name(key): key for key in index.present}
        on_disk = self._files.scan()
        rows = []
        for name, path in on_disk.items():
            if name in by_name:
                continue
            found = self._files.block_info(path, name)
            if found is None:
                self._files.unlink_all([path])
                self._counts["corrupt"] += 1
            else:
                rows.append((found.key, found.nbytes, found.mtime_ns))
        missing = [key for name, key in by_name.items() if name not in on_disk]
        with index.write() as conn:
            index.adopt(conn, rows)
            for key in missing:
                if not self._files.exists(key):
                    index.remove(conn, key)
        index.reload()
        limit = self._limit_nbytes
        if limit is not None:
            # Adopted files may push usage past the capacity (of this
            # process, which may be smaller than the last one's).
            retired: list[str | None] = []
            evicted: list[bytes] = []
            with index.write() as conn:
                used = index.used_nbytes(conn)
                if used > limit:
                    evicted, _ = self._evict(conn, used - limit, retired)
            index.present.difference_update(evicted)
            self._counts["evictions"] += len(evicted)
            self._files.unlink_all(retired)

    # ------------------------------------------------------------------ state

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"store '{self.url}' is closed")

    def _evict(self, conn: sqlite3.Connection, need_nbytes: int,
               retired: list[str | None]) -> tuple[list[bytes], int]:
        """Evict least recently used blocks inside the index transaction
        ``conn``: rows first, then their files, to unlink after commit."""
        keys, freed = self._index.evict(conn, need_nbytes)
        retired.extend(self._files.retire(key) for key in keys)
        return keys, freed

    def _drop_bad(self, bad: list[tuple[bytes, int | None]]) -> None:
        """Drop rows whose file is gone, and remove damaged files (key,
        inode) with their rows.  Checked again under the write lock: a block
        re-put by another process since the failed read is kept."""
        retired: list[str | None] = []
        dropped: list[bytes] = []
        with self._lock:
            try:
                with self._index.write() as conn:
                    for key, inode in bad:
                        if inode is not None:
                            tmp = self._files.retire(key, inode)
                            if tmp is None and self._files.exists(key):
                                continue
                            retired.append(tmp)
                        elif self._files.exists(key):
                            continue
                        self._index.remove(conn, key)
                        dropped.append(key)
                self._index.present.difference_update(dropped)
            except sqlite3.Error:
                pass
        self._files.unlink_all(retired)

    # ------------------------------------------------------------------ KVStore

    def put(self, keys: Sequence[bytes], values: Sequence[bytes | Buffer]) -> list[bool]:
        check_batch(keys, values)
        keys = [bytes(k) for k in keys]
        results = [False] * len(keys)
        with self._lock:
            self._check_open()
            if self._index.unavailable is not None and not self._try_leave_read_only():
                self._counts["puts"] += len(keys)
                self._counts["put_failures"] += len(keys)
                return results
            self._index.try_sync()
            present = self._index.present
        limit = self._limit_nbytes
        published: list[_Published] = []
        first_of: dict[bytes, int] = {}
        repeats: list[tuple[int, int]] = []
        reused: list[bytes] = []
        for i, (key, value) in enumerate(zip(keys, values)):
            if key in first_of:
                repeats.append((i, first_of[key]))
                continue
            first_of[key] = i
            view = byte_view(value)
            if key in present and self._files.exists(key):
                results[i] = True
                reused.append(key)
                continue
            if limit is not None and view.nbytes > limit:
                continue
            inode = self._files.publish(key, view)
            if inode is not None:
                published.append(_Published(i, key, view.nbytes, inode))
        retired: list[str | None] = []
        if reused and not published:
            with self._lock:
                self._index.touch_and_flush_if_due(reused)
        elif published:
            with self._lock:
                self._check_open()
                try:
                    retired = self._index_puts(published, reused, results)
                except sqlite3.Error:
                    # The index could not take the rows: withdraw the files
                    # so no block stays unaccounted.
                    for block in published:
                        retired.append(self._files.retire(block.key, block.inode))
                        results[block.position] = False
        self._files.unlink_all(retired)
        for i, j in repeats:
            results[i] = results[j]
        with self._lock:
            self._counts["puts"] += len(keys)
            self._counts["put_failures"] += results.count(False)
        return results

    def _index_puts(self, published: list[_Published], reused: list[bytes], results: list[bool]) -> list[str | None]:
        """Insert the rows of freshly published blocks, evicting the least
        recently used ones to stay within capacity.  Returns the retired
        files of evicted blocks, to unlink once committed."""
        index = self._index
        limit = self._limit_nbytes
        retired: list[str | None] = []
        evicted: set[bytes] = set()
        index.touch(reused)
        with index.write() as conn:
            index.flush_touches(conn)
            used = 0 if limit is None else index.used_nbytes(conn)
            for block in published:
                if limit is not None and used + block.nbytes > limit:
                    keys, freed = self._evict(conn, used + block.nbytes - limit, retired)
                    evicted.update(keys)
                    used -= freed
                if block.key in evicted:
                    continue
                if index.insert(conn, block.key, block.nbytes):
                    used += block.nbytes
            index.trim_journal_if_due(conn)
        present = index.present
        present.difference_update(evicted)
        for block in published:
            if block.key not in evicted:
                results[block.position] = True
                present.add(block.key)
        self._counts["evictions"] += len(evicted)
        return retired

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        check_batch(keys, buffers, "buffers")
        reads = self._read_each(keys, lambda i, key: self._files.read_into(key, [byte_view(buffers[i], writable=True)]))
        return [read.status is ReadStatus.HIT for read in reads]

    reads_into_parts = True

    def get_into_parts(self, keys: Sequence[bytes], parts: Sequence[Sequence[Buffer]],
                       on_value: Callable[[int], object] | None = None) -> list[bool]:
        check_batch(keys, parts, "lists of parts")
        if any(len(value_parts) > MAX_PARTS for value_parts in parts):
            return super().get_into_parts(keys, parts, on_value)
        views = [[byte_view(p, writable=True) for p in value_parts] for value_parts in parts]

        def read_one(i: int, key: bytes) -> BlockRead:
            read = self._files.read_into(key, views[i])
            if on_value is not None and read.status is ReadStatus.HIT:
                on_value(i)
            return read

        reads = self._read_each(keys, read_one)
        return [read.status is ReadStatus.HIT for read in reads]

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        check_batch(keys)
        reads = self._read_each(keys, lambda _i, key: self._files.read(key))
        return [read.value if read.status is ReadStatus.HIT else None for read in reads]

    def _read_each(self, keys: Sequence[bytes], read_one: Callable[[int, bytes], BlockRead]) -> list[BlockRead]:
        """``read_one(position, key)`` for each key, then what the reads
        found: damaged files and rows without a file are dropped, hits and
        misses counted, and the hits noted as uses."""
        with self._lock:
            self._check_open()
        reads: list[BlockRead] = []
        hits: list[bytes] = []
        bad: list[tuple[bytes, int | None]] = []
        corrupt = 0
        for i, key in enumerate(keys):
            key = bytes(key)
            read = read_one(i, key)
            reads.append(read)
            if read.status is ReadStatus.HIT:
                hits.append(key)
            elif read.status is ReadStatus.CORRUPT:
                corrupt += 1
                bad.append((key, read.inode))
            elif read.status is ReadStatus.GONE and key in self._index.present:
                bad.append((key, None))
        if bad:
            self._drop_bad(bad)
        with self._lock:
            counts = self._counts
            counts["gets"] += len(keys)
            counts["hits"] += len(hits)
            counts["misses"] += len(keys) - len(hits)
            counts["corrupt"] += corrupt
            if not self._closed:
                self._index.touch_and_flush_if_due(hits)
        return reads

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        check_batch(keys)
        with self._lock:
            self._check_open()
            if self._index.unavailable is not None:
                return [self._files.exists(bytes(k)) for k in keys]
            self._index.try_sync()
            present = self._index.present
            return [(k if type(k) is bytes else bytes(k)) in present for k in keys]

    def prefix_len(self, keys: Sequence[bytes]) -> int:
        check_batch(keys)
        with self._lock:
            self._check_open()
            read_only = self._index.unavailable is not None
            if not read_only:
                self._index.try_sync()
            present = self._index.present
            n = 0
            for k in keys:
                if not (self._files.exists(bytes(k)) if read_only
                        else (k if type(k) is bytes else bytes(k)) in present):
                    break
                n += 1
            return n

    def delete(self, keys: Sequence[bytes]) -> None:
        check_batch(keys)
        keys = [bytes(k) for k in keys]
        retired: list[str | None] = []
        with self._lock:
            self._check_open()
            if self._index.unavailable is not None:
                # No index to write: remove the files only.  The next open
                # that can write the index drops their rows (rows without a
                # file), and deleting is how an operator frees the space.
                for key in keys:
                    self._index.forget_touch(key)
                    self._files.unlink(key)
                return
            try:
                with self._index.write() as conn:
                    for key in keys:
                        self._index.remove(conn, key)
                        self._index.forget_touch(key)
                        retired.append(self._files.retire(key))
                self._index.present.difference_update(keys)
            except sqlite3.Error as exc:
                raise StoreUnavailableError(f"store '{self.url}': the index did not take the delete: {exc}") from exc
            finally:
                self._files.unlink_all(retired)

    def stats(self) -> StoreStats:
        with self._lock:
            self._check_open()
            num_blocks = nbytes = None
            try:
                num_blocks, nbytes = self._index.usage()
            except sqlite3.Error:
                pass
            c = dict(self._counts)
            read_only = self._index.unavailable
        return StoreStats(
            url=self.url, kind="disk", read_only=read_only, num_blocks=num_blocks, nbytes=nbytes,
            capacity_nbytes=self.capacity_nbytes, num_evictions=c["evictions"], num_puts=c["puts"],
            num_gets=c["gets"], num_hits=c["hits"], num_misses=c["misses"], num_put_failures=c["put_failures"],
            num_corrupt=c["corrupt"],
            # "read_only" stays in extra too, for readers from before the typed field.
            extra={"path": self.root, "fsync": self.fsync, "index": self._index.path,
                   **({"read_only": read_only} if read_only is not None else {})})

    # ------------------------------------------------------------------ inspection

    def iter_keys(self, batch: int = 1000) -> Iterator[list[bytes]]:
        """The index's keys in key order, one page per query, so that blocks
        deleted between pages (``ucm store clear``) do not shift the walk."""
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        with self._lock:
            self._check_open()
            read_only = self._index.unavailable is not None
        if read_only:
            keys = self._files.keys_on_disk()
            for start in range(0, len(keys), batch):
                yield keys[start:start + batch]
            return
        after = b""
        while True:
            with self._lock:
                self._check_open()
                try:
                    keys = self._index.keys_after(after, batch)
                except sqlite3.Error as exc:
                    raise StoreUnavailableError(f"store '{self.url}': cannot read the index: {exc}") from exc
            if keys:
                yield keys
            if len(keys) < batch:
                return
            after = keys[-1]

    def peek(self, keys: Sequence[bytes], nbytes: int | None = None) -> list[tuple[int, bytes] | None]:
        """Reads the files without noting a use or counting a hit; a damaged
        file reads as ``None`` and is left alone (``get`` removes it)."""
        check_batch(keys)
        with self._lock:
            self._check_open()
        return [self._files.peek(bytes(key), nbytes) for key in keys]

    def last_used(self, keys: Sequence[bytes]) -> list[float | None]:
        """The index's access times: the last put or hit of any process,
        this process's unflushed hits included."""
        check_batch(keys)
        keys = [bytes(k) for k in keys]
        with self._lock:
            self._check_open()
            if self._index.unavailable is not None:
                return [None] * len(keys)  # the access times are in the index
            try:
                found = self._index.last_used(keys)
            except sqlite3.Error as exc:
                raise StoreUnavailableError(f"store '{self.url}': cannot read the index: {exc}") from exc
        return [None if key not in found else found[key] / 1e9 for key in keys]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._index.close()
