"""``disk://`` — KV blocks as files in a local directory, shared by processes.

URL::

    disk:///abs/path[?capacity=20GiB][&fsync=false][&touch_interval=1s]

* ``capacity``: the most value bytes the store keeps (file trailers of
  20 bytes + key length each come on top).  Putting past it evicts the
  least-recently-used blocks; a value larger than the capacity is refused.
  Without it the store is unbounded and puts fail (return ``False``) once the
  file system is full.  Give a capacity in production.
* ``fsync`` (default ``false``): fsync each block and its directory before
  it is published.  Off, a power loss can lose recent blocks or leave blocks
  of the right length with zeroed bytes (the connector's block checksum
  catches those); a process crash never can.  The store is a cache, so the
  default favours speed.
* ``touch_interval`` (default ``1s``): how long a process may keep the
  access times of its hits to itself before writing them to the shared
  index.  A process always writes its own pending access times before it
  evicts, so LRU order is exact within a process and at most this stale
  across processes.

What this module owns: the directory layout, the block file format, the
shared index and the crash and concurrency rules below.  It knows nothing of
what the bytes mean.

Layout.  ``<root>/<xx>/<name>`` where ``name`` is the 32-hex-digit
BLAKE2b-128 of the key and ``xx`` its first two digits (256 shards).  A key
never becomes part of a path, so no key can name a file outside ``root``.
Each file holds ``value | key | value length | key length | magic``; a read
checks all of them and that the file's size is exactly their sum, so a
hash collision, a truncated or an extended file is never returned as valid.
A bad file is counted in ``num_corrupt``, removed, and read as a miss.

Publishing.  A block is written to ``<name>.<pid>.<n>.tmp`` next to its final
name and renamed over it, so readers see a whole file or none, also when the
writer is killed.  Files are immutable once published: an open reader keeps
its whole file even when the block is evicted or replaced under it.
Temp files whose pid is gone (or older than ten minutes) are swept at open.

The index (``<root>/index.sqlite``, WAL) has one row per block (key, value
size, last access in ns) and, maintained by triggers in the same
transaction, the total size and a journal of additions and removals.  The
rules that keep it true under crashes and concurrent processes:

* A block's file is renamed into place before its row is inserted, and a
  row is deleted before its file is retired (renamed to a temp name inside
  the same transaction, unlinked after commit).  So a killed process leaves
  at worst a published file without a row, which the next open adopts, a
  temp file, which the next open sweeps, or a row without a file, which the
  first read that misses it drops.  Nothing stays unaccounted.
* All writes take SQLite's write lock (``BEGIN IMMEDIATE``), so capacity and
  eviction decisions of several processes are serialised.
* Each store object mirrors the set of stored keys in memory (about 100
  bytes per block) and catches up from the journal whenever ``PRAGMA
  data_version`` says another connection committed; ``contains`` and
  ``prefix_len`` are then set look-ups, and a block put by another process
  is visible at the next call.  ``contains`` trusts the index: a file
  removed behind the store's back reads as present until a read misses it.
* An index that is missing, unreadable or of another schema version is
  rebuilt at open by scanning the block files.  Usage above the capacity
  (adopted files, or a capacity smaller than the last process's) is evicted
  at open.

A full file system.  SQLite cannot open a WAL index without room for its
shared-memory file, so a store whose file system is 100% full (ENOSPC or
EDQUOT on a small write) opens read-only instead of failing: the files are
the truth then.  Reads work as always; ``contains`` looks for the file; puts
return ``False``; ``delete`` removes files only (their rows are dropped at
the next open, as for any row without a file); ``iter_keys`` scans the
files.  ``stats().extra["read_only"]`` says why.  Puts try the index again
at most every ``_FULL_RETRY_SECONDS``, so storing resumes once space is
freed, without a restart.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import logging
import os
import sqlite3
import struct
import threading
import time
import urllib.parse
from typing import Iterator, Sequence

from .base import Buffer, KVStore, byte_view, StoreError, StoreOpenError, StoreStats, StoreUnavailableError, check_batch
from .process import pid_alive
from .urls import mask_password, parse_bool, parse_seconds, parse_size, query_options, split_url

_MAGIC = b"UCMBLK\x00\x01"
# The fixed end of a block file: value length, key length, magic.  It sits
# after the value and the key so that the value starts at offset 0: reads
# from the page cache into page-aligned buffers stay aligned.
_TRAILER = struct.Struct("<QI8s")
_NAME_LEN = 32
_INDEX_FILE = "index.sqlite"
_LOCK_FILE = "open.lock"
_SCHEMA_VERSION = 1
_STALE_TMP_SECONDS = 600.0
_JOURNAL_KEEP = 65536
_TRIM_EVERY = 4096
_EVICT_CHUNK = 64
_BUSY_TIMEOUT_MS = 10000
_OPTIONS = {"capacity", "fsync", "touch_interval"}
_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# A write this large must fit for the index to open: SQLite's shared-memory
# file alone takes 32 KiB.
_SPACE_PROBE_NBYTES = 64 * 1024
_FULL_RETRY_SECONDS = 5.0

logger = logging.getLogger(__name__)

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS blocks (
    key BLOB PRIMARY KEY,
    nbytes INTEGER NOT NULL,
    atime INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS blocks_by_atime ON blocks (atime);
CREATE TABLE IF NOT EXISTS usage (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    num_blocks INTEGER NOT NULL,
    nbytes INTEGER NOT NULL,
    trimmed_seq INTEGER NOT NULL
);
INSERT OR IGNORE INTO usage VALUES (0, 0, 0, 0);
CREATE TABLE IF NOT EXISTS journal (
    seq INTEGER PRIMARY KEY,
    key BLOB NOT NULL,
    present INTEGER NOT NULL
);
CREATE TRIGGER IF NOT EXISTS blocks_added AFTER INSERT ON blocks BEGIN
    UPDATE usage SET num_blocks = num_blocks + 1, nbytes = nbytes + NEW.nbytes WHERE id = 0;
    INSERT INTO journal (key, present) VALUES (NEW.key, 1);
END;
CREATE TRIGGER IF NOT EXISTS blocks_removed AFTER DELETE ON blocks BEGIN
    UPDATE usage SET num_blocks = num_blocks - 1, nbytes = nbytes - OLD.nbytes WHERE id = 0;
    INSERT INTO journal (key, present) VALUES (OLD.key, 0);
END;
PRAGMA user_version = {_SCHEMA_VERSION};
"""

_HIT, _MISS, _GONE, _CORRUPT = range(4)


def block_name(key: bytes) -> str:
    """The file name of a key's block: fixed length, hex only."""
    return hashlib.blake2b(key, digest_size=16).hexdigest()


def _mount_point(path: str) -> str:
    path = os.path.realpath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


class _IndexUnavailable(sqlite3.OperationalError):
    """The store is read-only for want of space.  A sqlite3 error, so that
    every path that already copes with a failing index (a put withdraws its
    files, touches wait, stats show no usage) copes with this too."""


class DiskStore(KVStore):
    """Blocks as files under one directory; see the module docstring."""

    def __init__(self, root: str, *, capacity_nbytes: int | None = None, fsync: bool = False,
                 touch_interval: float = 1.0, url: str | None = None) -> None:
        self.root = os.path.abspath(root)
        self.url = mask_password(url) if url else f"disk://{self.root}"
        self.capacity_nbytes = capacity_nbytes
        self.fsync = fsync
        self.touch_interval = touch_interval
        self._lock = threading.RLock()
        self._counter = itertools.count()
        self._conn: sqlite3.Connection | None = None
        self._pid = os.getpid()
        self._closed = False
        self._present: set[bytes] = set()
        self._seq = 0
        self._data_version: int | None = None
        self._need_reload = True
        self._pending_touch: dict[bytes, int] = {}
        self._last_touch_flush = time.monotonic()
        self._last_stamp = 0
        self._journal_writes = 0
        self._counts = dict(puts=0, gets=0, hits=0, misses=0, put_failures=0, corrupt=0, evictions=0)
        self._read_only: str | None = None   # why, while the file system is full
        self._last_index_try = 0.0
        self._open()

    # ------------------------------------------------------------------ opening

    @classmethod
    def from_url(cls, url: str) -> "DiskStore":
        shown = mask_password(url)
        parts = split_url(url)
        if parts.scheme.lower() != "disk":
            raise StoreOpenError(f"store '{shown}' is not a disk:// URL")
        if "@" in parts.netloc:
            raise StoreOpenError(
                f"store '{shown}': a disk URL takes no user name or password; write it like disk:///var/cache/ucm")
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
        return cls(path, capacity_nbytes=capacity, fsync=fsync, touch_interval=touch, url=url)

    def _open_error(self, what: str, exc: BaseException | None = None) -> StoreOpenError:
        detail = f": {exc.strerror or exc}" if isinstance(exc, OSError) else (f": {exc}" if exc else "")
        return StoreOpenError(f"store '{self.url}': {what}{detail}")

    def _open(self) -> None:
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
            self._read_only = (
                f"no space left on device: the file system mounted at {mount} "
                f"is full, so the store's index cannot be written; its blocks are read, new blocks are not "
                f"stored until space is freed (free space there, `ucm store clear` this store, or give it a "
                f"capacity below the free space)")
            self._last_index_try = time.monotonic()
            logger.warning("store '%s' opened read-only: %s (%s)", self.url, self._read_only, exc)

    def _no_space_left(self) -> bool:
        """Whether the file system refuses to grow a file, the way it
        refused SQLite (which reports only "disk I/O error" then)."""
        probe = os.path.join(self.root, f".space.{os.getpid()}.{next(self._counter)}.tmp")
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
            with contextlib.suppress(OSError):
                os.unlink(probe)

    def _try_leave_read_only(self) -> bool:
        """Open the index again if space was freed; at most every
        ``_FULL_RETRY_SECONDS``.  Caller holds ``self._lock``."""
        now = time.monotonic()
        if now - self._last_index_try < _FULL_RETRY_SECONDS:
            return False
        self._last_index_try = now
        reason, self._read_only = self._read_only, None
        try:
            self._open_index()
        except StoreOpenError:
            self._read_only = reason
            return False
        logger.warning("store '%s': the index can be written again; storing blocks again", self.url)
        return True

    def _open_index(self) -> None:
        """Check the directory, then open, check and reconcile the index;
        ``StoreOpenError`` on failure."""
        probe = os.path.join(self.root, f".probe.{os.getpid()}.{next(self._counter)}.tmp")
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            os.unlink(probe)
            for i in range(256):
                os.makedirs(os.path.join(self.root, f"{i:02x}"), exist_ok=True)
        except OSError as exc:
            raise self._open_error(f"the directory {self.root!r} is not writable", exc) from exc
        try:
            lock_fd = os.open(os.path.join(self.root, _LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise self._open_error("cannot create the lock file", exc) from exc
        try:
            # Only one process at a time checks, rebuilds and reconciles the
            # index with the files; the others wait here for a consistent one.
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            try:
                self._conn = self._connect_checked()
                self._reload_mirror()
                self._reconcile_with_files()
            except sqlite3.Error as exc:
                self._close_conn()
                raise self._open_error("cannot use the index", exc) from exc
            except OSError as exc:
                self._close_conn()
                raise self._open_error("cannot scan the block files", exc) from exc
        finally:
            os.close(lock_fd)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(os.path.join(self.root, _INDEX_FILE), isolation_level=None,
                               check_same_thread=False, timeout=_BUSY_TIMEOUT_MS / 1000)
        try:
            conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
            # Small pages keep each commit's WAL write small: a put touches
            # four pages (row, access-time index, usage, journal).  Only
            # takes effect on a new index.
            conn.execute("PRAGMA page_size = 1024")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute(f"PRAGMA synchronous = {'FULL' if self.fsync else 'NORMAL'}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _connect_checked(self) -> sqlite3.Connection:
        """A connection to a sound index of this schema version; a missing,
        damaged or foreign one is replaced by an empty one that the file
        scan then fills."""
        try:
            conn = self._connect()
            try:
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                sound = conn.execute("PRAGMA quick_check").fetchone()[0] == "ok"
                if sound and version in (0, _SCHEMA_VERSION):
                    if version == 0:
                        conn.executescript(_SCHEMA)
                    return conn
            except BaseException:
                conn.close()
                raise
            conn.close()
        except sqlite3.DatabaseError as exc:
            if getattr(exc, "sqlite_errorcode", 0) & 0xFF not in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
                raise
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.root, _INDEX_FILE + suffix))
        conn = self._connect()
        conn.executescript(_SCHEMA)
        return conn

    def _reconcile_with_files(self) -> None:
        """Sweep dead writers' temp files, adopt published files that have no
        row (a writer killed between rename and insert, or a lost index) and
        drop rows whose file is gone."""
        now = time.time()
        on_disk: set[str] = set()
        adopt: list[tuple[str, os.DirEntry]] = []
        by_name = {block_name(key): key for key in self._present}
        with os.scandir(self.root) as entries:
            for entry in entries:
                if entry.name.endswith(".tmp"):
                    self._sweep_tmp(entry, now)
        for i in range(256):
            shard = os.path.join(self.root, f"{i:02x}")
            with os.scandir(shard) as entries:
                for entry in entries:
                    name = entry.name
                    if name.endswith(".tmp"):
                        self._sweep_tmp(entry, now)
                    elif len(name) == _NAME_LEN and name.startswith(f"{i:02x}"):
                        on_disk.add(name)
                        if name not in by_name:
                            adopt.append((name, entry))
        missing = [key for name, key in by_name.items() if name not in on_disk]
        rows = []
        for name, entry in adopt:
            found = self._read_block_info(entry.path, name)
            if found is None:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                self._counts["corrupt"] += 1
            else:
                key, nbytes, mtime_ns = found
                rows.append((key, nbytes, mtime_ns))
        with self._write_txn() as conn:
            conn.executemany("INSERT OR IGNORE INTO blocks (key, nbytes, atime) VALUES (?, ?, ?)", rows)
            for key in missing:
                if not os.path.exists(self._path(block_name(key))):
                    conn.execute("DELETE FROM blocks WHERE key = ?", (key,))
        self._reload_mirror()
        if self.capacity_nbytes is not None:
            # Adopted files may push usage past the capacity (of this
            # process, which may be smaller than the last one's).
            retired: list[str | None] = []
            evicted: set[bytes] = set()
            with self._write_txn() as conn:
                used = conn.execute("SELECT nbytes FROM usage").fetchone()[0]
                if used > self.capacity_nbytes:
                    self._evict(conn, used - self.capacity_nbytes, used, evicted, retired)
            self._present.difference_update(evicted)
            self._counts["evictions"] += len(evicted)
            self._unlink_all(retired)

    def _sweep_tmp(self, entry: os.DirEntry, now: float) -> None:
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

    @staticmethod
    def _inspect(fd: int) -> tuple[bytes, int, os.stat_result] | None:
        """(key, value size, stat) from a block file's own trailer, or None
        where the file is not a sound block."""
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
        return key, nbytes, st

    def _read_block_info(self, path: str, name: str) -> tuple[bytes, int, int] | None:
        """(key, value size, mtime) of a sound block file, else None."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            found = self._inspect(fd)
        except OSError:
            return None
        finally:
            os.close(fd)
        if found is None or block_name(found[0]) != name:
            return None
        key, nbytes, st = found
        return key, nbytes, st.st_mtime_ns

    # ------------------------------------------------------------------ index

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"store '{self.url}' is closed")

    def _db(self) -> sqlite3.Connection:
        self._check_open()
        if self._read_only is not None:
            raise _IndexUnavailable(self._read_only)
        if self._pid != os.getpid():
            # A connection must not cross a fork; the child opens its own.
            self._conn = None
            self._pid = os.getpid()
            self._pending_touch.clear()
            self._need_reload = True
        if self._conn is None:
            self._conn = self._connect()
        return self._conn

    @contextlib.contextmanager
    def _write_txn(self) -> Iterator[sqlite3.Connection]:
        conn = self._db()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
            conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise

    def _reload_mirror(self) -> None:
        conn = self._db()
        conn.execute("BEGIN")
        try:
            present = {row[0] for row in conn.execute("SELECT key FROM blocks")}
            seq = conn.execute(
                "SELECT max(coalesce((SELECT max(seq) FROM journal), 0), trimmed_seq) FROM usage"
            ).fetchone()[0]
            self._data_version = conn.execute("PRAGMA data_version").fetchone()[0]
        finally:
            conn.execute("COMMIT")
        self._present, self._seq, self._need_reload = present, seq, False

    def _sync_mirror(self) -> None:
        """Bring the in-memory key set up to date with every committed change
        of every process.  Caller holds ``self._lock``.

        This process's own commits are applied to the set by the code that
        made them (they do not change data_version); a catch-up replays them
        again in journal order together with the others', which is harmless."""
        conn = self._db()
        if not self._need_reload:
            if conn.execute("PRAGMA data_version").fetchone()[0] == self._data_version:
                return
            conn.execute("BEGIN")
            try:
                self._catch_up(conn)
            finally:
                conn.execute("COMMIT")
        if self._need_reload:
            self._reload_mirror()

    def _catch_up(self, conn: sqlite3.Connection) -> None:
        """Apply the journal's changes since the last catch-up; inside a
        transaction, so what is applied and the data_version match."""
        self._data_version = conn.execute("PRAGMA data_version").fetchone()[0]
        trimmed = conn.execute("SELECT trimmed_seq FROM usage").fetchone()[0]
        if self._seq < trimmed:
            self._need_reload = True
            return
        changes = conn.execute(
            "SELECT seq, key, present FROM journal WHERE seq > ? ORDER BY seq", (self._seq,)).fetchall()
        present = self._present
        for _, key, added in changes:
            if added:
                present.add(key)
            else:
                present.discard(key)
        if changes:
            self._seq = changes[-1][0]

    def _try_sync_mirror(self) -> None:
        # A busy or failing index only makes the mirror older; reads of the
        # files still answer correctly, so this never raises.
        try:
            self._sync_mirror()
        except sqlite3.Error:
            pass

    def _stamp(self) -> int:
        """Access times: wall-clock ns, strictly increasing in this process
        so that the order of one batch is kept."""
        stamp = max(time.time_ns(), self._last_stamp + 1)
        self._last_stamp = stamp
        return stamp

    def _flush_touches(self, conn: sqlite3.Connection) -> None:
        if self._pending_touch:
            conn.executemany("UPDATE blocks SET atime = ? WHERE key = ?",
                             [(t, k) for k, t in self._pending_touch.items()])
            self._pending_touch.clear()
        self._last_touch_flush = time.monotonic()

    def _note_touches(self, keys: list[bytes]) -> None:
        """Caller holds ``self._lock``."""
        for key in keys:
            self._pending_touch[key] = self._stamp()
        if self._pending_touch and time.monotonic() - self._last_touch_flush >= self.touch_interval:
            try:
                with self._write_txn() as conn:
                    self._flush_touches(conn)
            except sqlite3.Error:
                pass

    def _retire(self, path: str, inode: int | None = None) -> str | None:
        """Move a block file out of its name (to a temp name the sweep
        removes if this process dies before unlinking it).  With ``inode``,
        only if the name still holds that file."""
        tmp = f"{path}.{os.getpid()}.{next(self._counter)}.tmp"
        try:
            if inode is not None and os.stat(path).st_ino != inode:
                return None
            os.rename(path, tmp)
        except OSError:
            return None
        return tmp

    @staticmethod
    def _unlink_all(paths: list[str | None]) -> None:
        for path in paths:
            if path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(path)

    def _drop_bad(self, bad: list[tuple[bytes, int | None]]) -> None:
        """Drop rows whose file is gone, and remove damaged files with their
        rows.  Checked again under the write lock: a block re-put by another
        process since the failed read is kept."""
        retired: list[str | None] = []
        dropped: list[bytes] = []
        with self._lock:
            try:
                with self._write_txn() as conn:
                    for key, inode in bad:
                        path = self._path(block_name(key))
                        if inode is not None:
                            tmp = self._retire(path, inode)
                            if tmp is None and os.path.exists(path):
                                continue
                            retired.append(tmp)
                        elif os.path.exists(path):
                            continue
                        conn.execute("DELETE FROM blocks WHERE key = ?", (key,))
                        dropped.append(key)
                self._present.difference_update(dropped)
            except sqlite3.Error:
                pass
        self._unlink_all(retired)

    # ------------------------------------------------------------------ files

    def _path(self, name: str) -> str:
        return f"{self.root}/{name[:2]}/{name}"

    def _write_file(self, key: bytes, value: memoryview, path: str) -> int | None:
        """Publish one block; its inode, or None where it could not be
        written (nothing is left behind then)."""
        tmp = f"{path}.{os.getpid()}.{next(self._counter)}.tmp"
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
                        pending = self._advance(pending, n)
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

    @staticmethod
    def _advance(views: list[memoryview], n: int) -> list[memoryview]:
        out = []
        for view in views:
            if n >= view.nbytes:
                n -= view.nbytes
                continue
            out.append(view[n:])
            n = 0
        return out

    def _read_into(self, key: bytes, view: memoryview) -> tuple[int, int | None]:
        """Read one block straight into ``view``: (status, inode of a
        damaged file).  One read where the file is what the buffer expects;
        anything else is judged by the file's own trailer."""
        try:
            fd = os.open(self._path(block_name(key)), os.O_RDONLY)
        except OSError:
            return _GONE, None
        try:
            trailer = bytearray(len(key) + _TRAILER.size)
            extra = bytearray(1)
            n = os.preadv(fd, [view, trailer, extra], 0)
            if n == view.nbytes + len(trailer):
                nbytes, key_len, magic = _TRAILER.unpack_from(trailer, len(key))
                if magic == _MAGIC and nbytes == view.nbytes and key_len == len(key) \
                        and trailer[:len(key)] == key:
                    return _HIT, None
            return self._judge(fd, key)
        except OSError:
            return _MISS, None
        finally:
            os.close(fd)

    def _read(self, key: bytes) -> tuple[int, int | None, bytes | None]:
        try:
            fd = os.open(self._path(block_name(key)), os.O_RDONLY)
        except OSError:
            return _GONE, None, None
        try:
            found = self._inspect(fd)
            if found is None or found[0] != key:
                status, inode = self._judge(fd, key)
                return status, inode, None
            _, nbytes, st = found
            value = os.pread(fd, nbytes, 0) if nbytes else b""
            if len(value) != nbytes:
                return _CORRUPT, st.st_ino, None
            return _HIT, None, value
        except OSError:
            return _MISS, None, None
        finally:
            os.close(fd)

    def _judge(self, fd: int, key: bytes) -> tuple[int, int | None]:
        """Why a block could not be read as expected: a sound block of
        another size (a miss), another key whose name collides (a miss that
        leaves that block alone, in theory only), or a damaged file."""
        try:
            found = self._inspect(fd)
            if found is not None:
                other = found[0]
                if other == key or block_name(other) == block_name(key):
                    return _MISS, None
            return _CORRUPT, os.fstat(fd).st_ino
        except OSError:
            return _MISS, None

    # ------------------------------------------------------------------ KVStore

    def put(self, keys: Sequence[bytes], values: Sequence[bytes | Buffer]) -> list[bool]:
        check_batch(keys, values)
        keys = [bytes(k) for k in keys]
        results = [False] * len(keys)
        with self._lock:
            self._check_open()
            if self._read_only is not None and not self._try_leave_read_only():
                self._counts["puts"] += len(keys)
                self._counts["put_failures"] += len(keys)
                return results
            self._try_sync_mirror()
            present = self._present
        capacity = self.capacity_nbytes
        written: list[tuple[int, bytes, int, str, int]] = []
        first_of: dict[bytes, int] = {}
        repeats: list[tuple[int, int]] = []
        reused: list[bytes] = []
        for i, (key, value) in enumerate(zip(keys, values)):
            if key in first_of:
                repeats.append((i, first_of[key]))
                continue
            first_of[key] = i
            view = byte_view(value)
            path = self._path(block_name(key))
            if key in present and os.path.exists(path):
                results[i] = True
                reused.append(key)
                continue
            if capacity is not None and view.nbytes > capacity:
                continue
            inode = self._write_file(key, view, path)
            if inode is not None:
                written.append((i, key, view.nbytes, path, inode))
        retired: list[str | None] = []
        if reused and not written:
            with self._lock:
                self._note_touches(reused)
        elif written:
            with self._lock:
                try:
                    retired = self._index_puts(written, reused, results)
                except sqlite3.Error:
                    # The index could not take the rows: withdraw the files
                    # so no block stays unaccounted.
                    for i, key, nbytes, path, inode in written:
                        retired.append(self._retire(path, inode))
                        results[i] = False
        self._unlink_all(retired)
        for i, j in repeats:
            results[i] = results[j]
        with self._lock:
            self._counts["puts"] += len(keys)
            self._counts["put_failures"] += results.count(False)
        return results

    def _index_puts(self, written: list[tuple[int, bytes, int, str, int]], reused: list[bytes],
                    results: list[bool]) -> list[str | None]:
        """Insert the rows of freshly written blocks, evicting the least
        recently used ones to stay within capacity.  Returns the retired
        files of evicted blocks, to unlink once committed."""
        capacity = self.capacity_nbytes
        retired: list[str | None] = []
        evicted: set[bytes] = set()
        for key in reused:
            self._pending_touch[key] = self._stamp()
        with self._write_txn() as conn:
            self._flush_touches(conn)
            used = 0 if capacity is None else conn.execute("SELECT nbytes FROM usage").fetchone()[0]
            for i, key, nbytes, path, inode in written:
                if capacity is not None and used + nbytes > capacity:
                    used = self._evict(conn, used + nbytes - capacity, used, evicted, retired)
                if key in evicted:
                    continue
                inserted = conn.execute("INSERT OR IGNORE INTO blocks (key, nbytes, atime) VALUES (?, ?, ?)",
                                        (key, nbytes, self._stamp())).rowcount
                used += nbytes if inserted == 1 else 0
                self._journal_writes += 1
            if self._journal_writes >= _TRIM_EVERY:
                self._journal_writes = 0
                self._trim_journal(conn)
        present = self._present
        present.difference_update(evicted)
        for i, key, nbytes, path, inode in written:
            if key not in evicted:
                results[i] = True
                present.add(key)
        self._counts["evictions"] += len(evicted)
        return retired

    def _evict(self, conn: sqlite3.Connection, need: int, used: int, evicted: set[bytes],
               retired: list[str | None]) -> int:
        freed = 0
        while freed < need:
            rows = conn.execute("SELECT key, nbytes FROM blocks ORDER BY atime LIMIT ?", (_EVICT_CHUNK,)).fetchall()
            if not rows:
                break
            for key, nbytes in rows:
                if freed >= need:
                    break
                conn.execute("DELETE FROM blocks WHERE key = ?", (key,))
                retired.append(self._retire(self._path(block_name(key))))
                evicted.add(key)
                freed += nbytes
                self._journal_writes += 1
        return used - freed

    @staticmethod
    def _trim_journal(conn: sqlite3.Connection) -> None:
        top = conn.execute("SELECT coalesce(max(seq), 0) FROM journal").fetchone()[0]
        trimmed = conn.execute("SELECT trimmed_seq FROM usage").fetchone()[0]
        if top - trimmed > 2 * _JOURNAL_KEEP:
            cut = top - _JOURNAL_KEEP
            conn.execute("DELETE FROM journal WHERE seq <= ?", (cut,))
            conn.execute("UPDATE usage SET trimmed_seq = ?", (cut,))

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        check_batch(keys, buffers, "buffers")
        with self._lock:
            self._check_open()
        results = [False] * len(keys)
        hits: list[bytes] = []
        bad: list[tuple[bytes, int | None]] = []
        corrupt = 0
        for i, (key, buffer) in enumerate(zip(keys, buffers)):
            key = bytes(key)
            status, inode = self._read_into(key, byte_view(buffer, writable=True))
            if status == _HIT:
                results[i] = True
                hits.append(key)
            elif status == _CORRUPT:
                corrupt += 1
                bad.append((key, inode))
            elif status == _GONE and key in self._present:
                bad.append((key, None))
        self._after_reads(len(keys), hits, bad, corrupt)
        return results

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        check_batch(keys)
        with self._lock:
            self._check_open()
        results: list[bytes | None] = [None] * len(keys)
        hits: list[bytes] = []
        bad: list[tuple[bytes, int | None]] = []
        corrupt = 0
        for i, key in enumerate(keys):
            key = bytes(key)
            status, inode, value = self._read(key)
            if status == _HIT:
                results[i] = value
                hits.append(key)
            elif status == _CORRUPT:
                corrupt += 1
                bad.append((key, inode))
            elif status == _GONE and key in self._present:
                bad.append((key, None))
        self._after_reads(len(keys), hits, bad, corrupt)
        return results

    def _after_reads(self, num_keys: int, hits: list[bytes], bad: list[tuple[bytes, int | None]],
                     corrupt: int) -> None:
        if bad:
            self._drop_bad(bad)
        with self._lock:
            counts = self._counts
            counts["gets"] += num_keys
            counts["hits"] += len(hits)
            counts["misses"] += num_keys - len(hits)
            counts["corrupt"] += corrupt
            if not self._closed:
                self._note_touches(hits)

    def _on_disk(self, key: bytes) -> bool:
        return os.path.exists(self._path(block_name(bytes(key))))

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        check_batch(keys)
        with self._lock:
            self._check_open()
            if self._read_only is not None:
                return [self._on_disk(k) for k in keys]
            self._try_sync_mirror()
            present = self._present
            return [(k if type(k) is bytes else bytes(k)) in present for k in keys]

    def prefix_len(self, keys: Sequence[bytes]) -> int:
        check_batch(keys)
        with self._lock:
            self._check_open()
            read_only = self._read_only is not None
            if not read_only:
                self._try_sync_mirror()
            present = self._present
            n = 0
            for k in keys:
                if not (self._on_disk(k) if read_only else (k if type(k) is bytes else bytes(k)) in present):
                    break
                n += 1
            return n

    def delete(self, keys: Sequence[bytes]) -> None:
        check_batch(keys)
        retired: list[str | None] = []
        with self._lock:
            self._check_open()
            if self._read_only is not None:
                # No index to write: remove the files only.  The next open
                # that can write the index drops their rows (rows without a
                # file), and deleting is how an operator frees the space.
                for key in keys:
                    self._pending_touch.pop(bytes(key), None)
                    with contextlib.suppress(OSError):
                        os.unlink(self._path(block_name(bytes(key))))
                return
            try:
                with self._write_txn() as conn:
                    for key in keys:
                        key = bytes(key)
                        conn.execute("DELETE FROM blocks WHERE key = ?", (key,))
                        self._pending_touch.pop(key, None)
                        retired.append(self._retire(self._path(block_name(key))))
                self._present.difference_update(bytes(k) for k in keys)
            except sqlite3.Error as exc:
                raise StoreUnavailableError(f"store '{self.url}': the index did not take the delete: {exc}") from exc
            finally:
                self._unlink_all(retired)

    def stats(self) -> StoreStats:
        with self._lock:
            num_blocks = nbytes = None
            try:
                num_blocks, nbytes = self._db().execute("SELECT num_blocks, nbytes FROM usage").fetchone()
            except sqlite3.Error:
                pass
            c = dict(self._counts)
        return StoreStats(
            url=self.url, num_blocks=num_blocks, nbytes=nbytes, capacity_nbytes=self.capacity_nbytes,
            num_evictions=c["evictions"], num_puts=c["puts"], num_gets=c["gets"], num_hits=c["hits"],
            num_misses=c["misses"], num_put_failures=c["put_failures"], num_corrupt=c["corrupt"],
            extra={"path": self.root, "fsync": self.fsync, "index": os.path.join(self.root, _INDEX_FILE),
                   **({"read_only": self._read_only} if self._read_only is not None else {})})

    # ------------------------------------------------------------------ inspection

    def iter_keys(self, batch: int = 1000) -> Iterator[list[bytes]]:
        """The index's keys in key order, one page per query, so that blocks
        deleted between pages (``ucm store clear``) do not shift the walk."""
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        with self._lock:
            self._check_open()
            read_only = self._read_only is not None
        if read_only:
            keys = self._keys_on_disk()
            for start in range(0, len(keys), batch):
                yield keys[start:start + batch]
            return
        after = b""
        while True:
            with self._lock:
                try:
                    rows = self._db().execute(
                        "SELECT key FROM blocks WHERE key > ? ORDER BY key LIMIT ?", (after, batch)).fetchall()
                except sqlite3.Error as exc:
                    raise StoreUnavailableError(f"store '{self.url}': cannot read the index: {exc}") from exc
            keys = [bytes(row[0]) for row in rows]
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
        out: list[tuple[int, bytes] | None] = []
        for key in keys:
            key = bytes(key)
            try:
                fd = os.open(self._path(block_name(key)), os.O_RDONLY)
            except OSError:
                out.append(None)
                continue
            try:
                found = self._inspect(fd)
                if found is None or found[0] != key:
                    out.append(None)
                    continue
                size = found[1]
                want = size if nbytes is None else min(nbytes, size)
                data = os.pread(fd, want, 0) if want else b""
                out.append((size, data) if len(data) == want else None)
            except OSError:
                out.append(None)
            finally:
                os.close(fd)
        return out

    def _keys_on_disk(self) -> list[bytes]:
        """Every sound block file's key, from the files (read-only mode)."""
        keys = []
        for i in range(256):
            try:
                entries = os.scandir(os.path.join(self.root, f"{i:02x}"))
            except FileNotFoundError:
                continue
            with entries:
                for entry in entries:
                    if len(entry.name) == _NAME_LEN and entry.name.startswith(f"{i:02x}"):
                        found = self._read_block_info(entry.path, entry.name)
                        if found is not None:
                            keys.append(found[0])
        return sorted(keys)

    def last_used(self, keys: Sequence[bytes]) -> list[float | None]:
        """The index's access times: the last put or hit of any process,
        this process's unflushed hits included."""
        check_batch(keys)
        keys = [bytes(k) for k in keys]
        found: dict[bytes, int] = {}
        with self._lock:
            self._check_open()
            if self._read_only is not None:
                return [None] * len(keys)  # the access times are in the index
            try:
                conn = self._db()
                for start in range(0, len(keys), 500):
                    part = keys[start:start + 500]
                    marks = ",".join("?" * len(part))
                    found.update((bytes(k), t) for k, t in conn.execute(
                        f"SELECT key, atime FROM blocks WHERE key IN ({marks})", part))
            except sqlite3.Error as exc:
                raise StoreUnavailableError(f"store '{self.url}': cannot read the index: {exc}") from exc
            for key, stamp in self._pending_touch.items():
                if key in found:
                    found[key] = max(found[key], stamp)
        return [None if key not in found else found[key] / 1e9 for key in keys]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            if self._conn is not None and self._pid == os.getpid():
                try:
                    if self._pending_touch:
                        with self._write_txn() as conn:
                            self._flush_touches(conn)
                except sqlite3.Error:
                    pass
            self._closed = True
            self._close_conn()

    def _close_conn(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            self._conn = None
