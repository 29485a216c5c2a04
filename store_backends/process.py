"""Whether a process that left something behind (a temp file, a write
lease) is still there to finish it."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """False for a process that is gone or a zombie (which can no longer
    write).  A process of another user counts as alive."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        # os.open/os.read, not open(): this runs before every lookup of an
        # shm store, and the file object's layers cost more than the read.
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        try:
            stat = os.read(fd, 1024)
        finally:
            os.close(fd)
        state = stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3]
        return state not in (b"Z", b"X")
    except (OSError, ValueError):
        return True
