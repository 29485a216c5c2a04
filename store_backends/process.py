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
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        state = stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3]
        return state not in (b"Z", b"X")
    except (OSError, ValueError):
        return True
