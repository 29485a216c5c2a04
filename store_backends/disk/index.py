"""The shared SQLite index of a disk store: which blocks are stored, their
sizes and last accesses, shared by every process that opens the directory.

``<root>/index.sqlite`` (WAL) has one row per block (key, value size, last
access in ns) and, maintained by triggers in the same transaction, the total
size and a journal of additions and removals.  All writes take SQLite's
write lock (``BEGIN IMMEDIATE``), so capacity and eviction decisions of
several processes are serialised.

Each ``BlockIndex`` mirrors the set of stored keys in memory (about 100 bytes
per block) and catches up from the journal whenever ``PRAGMA data_version``
says another connection committed, so that ``contains`` is a set look-up and
a block put by another process is visible at the next call.  Access times of
hits are kept in memory and written at most every ``touch_interval``, and
always before an eviction, so LRU order is exact within a process and at
most that stale across processes.

This module owns the schema (and replacing an index that is damaged or of
another version), the connection (one per process, never carried across a
fork), the key mirror, access times and the choice of eviction victims.  It
must not touch block files: ``evict`` deletes rows and returns their keys,
and the store retires their files inside the same transaction.  It is not
thread-safe by itself: the store calls it under its own lock.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from typing import Iterator, Sequence

from .layout import INDEX_FILE

_SCHEMA_VERSION = 1
_JOURNAL_KEEP = 65536
_TRIM_EVERY = 4096
_EVICT_CHUNK = 64
_BUSY_TIMEOUT_MS = 10000

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


class IndexUnavailable(sqlite3.OperationalError):
    """The index cannot be written for want of space.  A sqlite3 error, so
    that every path that already copes with a failing index (a put withdraws
    its files, touches wait, stats show no usage) copes with this too."""


class BlockIndex:
    """The index of the store under ``root``; see the module docstring."""

    def __init__(self, root: str, *, fsync: bool = False, touch_interval: float = 1.0) -> None:
        self.root = root
        self.path = os.path.join(root, INDEX_FILE)
        self.fsync = fsync
        self.touch_interval = touch_interval
        #: Why the index cannot be used (the store is read-only), or None.
        self.unavailable: str | None = None
        #: The stored keys, as of the last ``sync``.
        self.present: set[bytes] = set()
        #: The journal position ``present`` has caught up to.
        self.seq = 0
        self._conn: sqlite3.Connection | None = None
        self._closed = False
        self._pid = os.getpid()
        self._data_version: int | None = None
        self._need_reload = True
        self._pending_touch: dict[bytes, int] = {}
        self._last_touch_flush = time.monotonic()
        self._last_stamp = 0
        self._journal_writes = 0

    # ------------------------------------------------------------------ connections

    def open(self) -> None:
        """Connect to a sound index of this schema (replacing a missing,
        damaged or foreign one by an empty one) and load the key mirror;
        ``sqlite3.Error`` on failure."""
        self._conn = self._connect_checked()
        self.reload()

    def db(self) -> sqlite3.Connection:
        """This process's connection."""
        if self._closed:
            raise sqlite3.ProgrammingError(f"the index {self.path!r} is closed")
        if self.unavailable is not None:
            raise IndexUnavailable(self.unavailable)
        if self._pid != os.getpid():
            # A connection must not cross a fork; the child opens its own.
            self._conn = None
            self._pid = os.getpid()
            self._pending_touch.clear()
            self._need_reload = True
        if self._conn is None:
            self._conn = self._connect()
        return self._conn

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None,
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
        damaged or foreign one is replaced by an empty one that the store's
        file scan then fills."""
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
                os.unlink(self.path + suffix)
        conn = self._connect()
        conn.executescript(_SCHEMA)
        return conn

    def close(self) -> None:
        """Write pending access times (in the process that made them) and
        close the connection."""
        if self._conn is not None and self._pid == os.getpid():
            try:
                if self._pending_touch:
                    with self.write() as conn:
                        self.flush_touches(conn)
            except sqlite3.Error:
                pass
        self._closed = True
        self.close_conn()

    def close_conn(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            self._conn = None

    @contextlib.contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """A write transaction: holds SQLite's write lock until it ends."""
        conn = self.db()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
            conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise

    # ------------------------------------------------------------------ the key mirror

    def reload(self) -> None:
        conn = self.db()
        conn.execute("BEGIN")
        try:
            present = {row[0] for row in conn.execute("SELECT key FROM blocks")}
            seq = conn.execute(
                "SELECT max(coalesce((SELECT max(seq) FROM journal), 0), trimmed_seq) FROM usage"
            ).fetchone()[0]
            self._data_version = conn.execute("PRAGMA data_version").fetchone()[0]
        finally:
            conn.execute("COMMIT")
        self.present, self.seq, self._need_reload = present, seq, False

    def sync(self) -> None:
        """Bring ``present`` up to date with every committed change of every
        process.

        This process's own commits are applied to the set by the code that
        made them (they do not change data_version); a catch-up replays them
        again in journal order together with the others', which is harmless."""
        conn = self.db()
        if not self._need_reload:
            if conn.execute("PRAGMA data_version").fetchone()[0] == self._data_version:
                return
            conn.execute("BEGIN")
            try:
                self._catch_up(conn)
            finally:
                conn.execute("COMMIT")
        if self._need_reload:
            self.reload()

    def try_sync(self) -> None:
        # A busy or failing index only makes the mirror older; reads of the
        # files still answer correctly, so this never raises.
        try:
            self.sync()
        except sqlite3.Error:
            pass

    def _catch_up(self, conn: sqlite3.Connection) -> None:
        """Apply the journal's changes since the last catch-up; inside a
        transaction, so what is applied and the data_version match."""
        self._data_version = conn.execute("PRAGMA data_version").fetchone()[0]
        trimmed = conn.execute("SELECT trimmed_seq FROM usage").fetchone()[0]
        if self.seq < trimmed:
            self._need_reload = True
            return
        changes = conn.execute(
            "SELECT seq, key, present FROM journal WHERE seq > ? ORDER BY seq", (self.seq,)).fetchall()
        present = self.present
        for _, key, added in changes:
            if added:
                present.add(key)
            else:
                present.discard(key)
        if changes:
            self.seq = changes[-1][0]

    # ------------------------------------------------------------------ rows

    def insert(self, conn: sqlite3.Connection, key: bytes, nbytes: int) -> bool:
        """Add a freshly published block, used now; False where its row was
        there already."""
        self._journal_writes += 1
        return conn.execute("INSERT OR IGNORE INTO blocks (key, nbytes, atime) VALUES (?, ?, ?)",
                            (key, nbytes, self._stamp())).rowcount == 1

    @staticmethod
    def adopt(conn: sqlite3.Connection, rows: list[tuple[bytes, int, int]]) -> None:
        """Add rows (key, value size, access time in ns) for block files found
        without one."""
        conn.executemany("INSERT OR IGNORE INTO blocks (key, nbytes, atime) VALUES (?, ?, ?)", rows)

    @staticmethod
    def remove(conn: sqlite3.Connection, key: bytes) -> None:
        conn.execute("DELETE FROM blocks WHERE key = ?", (key,))

    @staticmethod
    def used_nbytes(conn: sqlite3.Connection) -> int:
        return conn.execute("SELECT nbytes FROM usage").fetchone()[0]

    def usage(self) -> tuple[int, int]:
        """(number of blocks, value bytes) of the whole store."""
        num_blocks, nbytes = self.db().execute("SELECT num_blocks, nbytes FROM usage").fetchone()
        return num_blocks, nbytes

    def evict(self, conn: sqlite3.Connection, need_nbytes: int) -> tuple[list[bytes], int]:
        """Delete the least recently used rows until ``need_nbytes`` are
        freed or none are left: (their keys, the bytes freed).  The caller
        retires their files before the transaction commits."""
        evicted: list[bytes] = []
        freed = 0
        while freed < need_nbytes:
            rows = conn.execute("SELECT key, nbytes FROM blocks ORDER BY atime LIMIT ?", (_EVICT_CHUNK,)).fetchall()
            if not rows:
                break
            for key, nbytes in rows:
                if freed >= need_nbytes:
                    break
                conn.execute("DELETE FROM blocks WHERE key = ?", (key,))
                evicted.append(key)
                freed += nbytes
                self._journal_writes += 1
        return evicted, freed

    def trim_journal_if_due(self, conn: sqlite3.Connection) -> None:
        """Keep the journal short; a mirror older than what is trimmed
        reloads the whole key set instead of catching up."""
        if self._journal_writes < _TRIM_EVERY:
            return
        self._journal_writes = 0
        top = conn.execute("SELECT coalesce(max(seq), 0) FROM journal").fetchone()[0]
        trimmed = conn.execute("SELECT trimmed_seq FROM usage").fetchone()[0]
        if top - trimmed > 2 * _JOURNAL_KEEP:
            cut = top - _JOURNAL_KEEP
            conn.execute("DELETE FROM journal WHERE seq <= ?", (cut,))
            conn.execute("UPDATE usage SET trimmed_seq = ?", (cut,))

    def keys_after(self, after: bytes, limit: int) -> list[bytes]:
        """Up to ``limit`` keys greater than ``after``, in key order."""
        rows = self.db().execute("SELECT key FROM blocks WHERE key > ? ORDER BY key LIMIT ?",
                                 (after, limit)).fetchall()
        return [bytes(row[0]) for row in rows]

    def last_used(self, keys: Sequence[bytes]) -> dict[bytes, int]:
        """Access times in ns of those keys that have a row, this process's
        unwritten hits included."""
        found: dict[bytes, int] = {}
        conn = self.db()
        for start in range(0, len(keys), 500):
            part = keys[start:start + 500]
            marks = ",".join("?" * len(part))
            found.update((bytes(k), t) for k, t in conn.execute(
                f"SELECT key, atime FROM blocks WHERE key IN ({marks})", part))
        for key, stamp in self._pending_touch.items():
            if key in found:
                found[key] = max(found[key], stamp)
        return found

    # ------------------------------------------------------------------ access times

    def _stamp(self) -> int:
        """Access times: wall-clock ns, strictly increasing in this process
        so that the order of one batch is kept."""
        stamp = max(time.time_ns(), self._last_stamp + 1)
        self._last_stamp = stamp
        return stamp

    def touch(self, keys: list[bytes]) -> None:
        """Note a use of each key now, to write later."""
        for key in keys:
            self._pending_touch[key] = self._stamp()

    def touch_and_flush_if_due(self, keys: list[bytes]) -> None:
        """Note a use of each key, and write the pending ones once
        ``touch_interval`` has passed since the last write."""
        self.touch(keys)
        if self._pending_touch and time.monotonic() - self._last_touch_flush >= self.touch_interval:
            try:
                with self.write() as conn:
                    self.flush_touches(conn)
            except sqlite3.Error:
                pass

    def flush_touches(self, conn: sqlite3.Connection) -> None:
        if self._pending_touch:
            conn.executemany("UPDATE blocks SET atime = ? WHERE key = ?",
                             [(t, k) for k, t in self._pending_touch.items()])
            self._pending_touch.clear()
        self._last_touch_flush = time.monotonic()

    def forget_touch(self, key: bytes) -> None:
        self._pending_touch.pop(key, None)
