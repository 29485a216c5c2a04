"""``python -m store_backends.shm_server serve|status|stop NAME``: the shm server's command line.

This module is only the documented entry point (clients start servers with
it, operators and scripts run it) and the names callers of the module that
held the server before ``store_backends.shm`` imported from it.  It owns
nothing: the server is ``store_backends.shm.server``, the wire format
``store_backends.shm.protocol``, the files ``store_backends.shm.paths``.  New
code uses the public admin API of ``store_backends.shm`` (``list_servers``,
``server_status``, ``stop_server``, ``server_running(name)``...) instead.
"""

from __future__ import annotations

import sys

from .shm.admin import server_status as _server_status
from .shm.admin import stop_server
from .shm.paths import SEGMENT_DIR, Paths, UnsafeRuntimeDir, check_rundir, name_arg, runtime_dir, valid_name
from .shm.protocol import (DEFAULT_CHUNK_NBYTES, DEFAULT_LEASE_TIMEOUT_S, EPOCH_FREE_OPS, EXIT_ALREADY_RUNNING,
                           PROTOCOL_VERSION, REPLY, REQUEST, Alloc, Flag, Op, Status, pack_keys, unpack_keys)
from .shm.server import IndexServer, main

# The protocol's numbers under the names this module gave them.
OP_HELLO, OP_CONTAINS, OP_PREFIX, OP_GET = Op.HELLO, Op.CONTAINS, Op.PREFIX, Op.GET
OP_ALLOC, OP_COMMIT, OP_ABORT, OP_DELETE = Op.ALLOC, Op.COMMIT, Op.ABORT, Op.DELETE
OP_STATS, OP_CLEAR, OP_SHUTDOWN, OP_KEYS = Op.STATS, Op.CLEAR, Op.SHUTDOWN, Op.KEYS
FLAG_OVERWRITE, FLAG_NO_TOUCH = Flag.OVERWRITE, Flag.NO_TOUCH
ST_OK, ST_STALE, ST_ERROR, ST_LEASE_GONE = Status.OK, Status.STALE, Status.ERROR, Status.LEASE_GONE
ALLOC_NEW, ALLOC_PRESENT, ALLOC_FAILED = Alloc.NEW, Alloc.PRESENT, Alloc.FAILED


def server_running(paths: Paths) -> bool:
    """Whether a live server holds the PID lock of ``paths.name`` (the
    signature this module had; ``store_backends.shm.server_running`` takes a
    NAME)."""
    return paths.server_running()


def server_status(name: str, rundir: str | None = None, timeout_s: float = 2.0) -> dict | None:
    """The figures of NAME's server as a dict, or None when none answers (the
    return this module had; ``store_backends.shm.server_status`` returns a
    ``ServerStatus``)."""
    status = _server_status(name, rundir, timeout_s)
    return status.to_dict() if status.answering else None


__all__ = [
    "ALLOC_FAILED", "ALLOC_NEW", "ALLOC_PRESENT", "DEFAULT_CHUNK_NBYTES", "DEFAULT_LEASE_TIMEOUT_S",
    "EPOCH_FREE_OPS", "EXIT_ALREADY_RUNNING", "FLAG_NO_TOUCH", "FLAG_OVERWRITE", "IndexServer", "OP_ABORT",
    "OP_ALLOC", "OP_CLEAR", "OP_COMMIT", "OP_CONTAINS", "OP_DELETE", "OP_GET", "OP_HELLO", "OP_KEYS",
    "OP_PREFIX", "OP_SHUTDOWN", "OP_STATS", "PROTOCOL_VERSION", "Paths", "REPLY", "REQUEST", "SEGMENT_DIR",
    "ST_ERROR", "ST_LEASE_GONE", "ST_OK", "ST_STALE", "UnsafeRuntimeDir", "check_rundir", "main", "name_arg",
    "pack_keys", "runtime_dir", "server_running", "server_status", "stop_server", "unpack_keys", "valid_name",
]

if __name__ == "__main__":
    sys.exit(main())
