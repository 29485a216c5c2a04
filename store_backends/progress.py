"""The one-line progress report of the command-line tools (``ucm``, ``ucm-bench``).

Owns counting work done and redrawing one line on a terminal stream:
``label: [#####   ] 120/480 keys (25%)`` when the total is known, else
``label: 120 keys``.  Two ways to use it:

* single-threaded (``ucm store ...``): ``advance(n)`` after each batch counts
  and redraws when a redraw is due;
* worker threads (``ucm-bench``): workers only ``add(n)``, which takes no
  terminal I/O, and the main thread calls ``draw()`` while it waits for them.

``close()`` wipes the line, so that what is printed next starts on a clean
line; drawing may start again after it.  A disabled report counts but never
writes.  Must not decide by itself whether to show (the commands do: a flag,
or whether stderr is a terminal), and knows nothing of stores or what is
being counted beyond the unit's name.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

#: At most this many redraws a second: a terminal that redraws on every
#: batch slows the walk it reports on.
REDRAW_INTERVAL_S = 0.2
BAR_WIDTH = 24


class Progress:
    """Work done so far, shown on one line of ``stream`` (stderr by default)."""

    def __init__(self, enabled: bool, label: str = "", total: int | None = None, *, unit: str = "keys",
                 stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.label = label
        #: The count at which the work is done; None or 0: unknown (no bar).
        self.total = total
        self.unit = unit
        self.count = 0
        self._stream = stream
        self._lock = threading.Lock()
        self._last_draw = float("-inf")
        self._width = 0

    def add(self, n: int = 1) -> None:
        """Count ``n`` more; never writes, so timed worker threads pay only
        for an uncontended lock."""
        with self._lock:
            self.count += n

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more and redraw if a redraw is due (one thread only)."""
        self.add(n)
        self.draw()

    def text(self) -> str:
        """The line as it is drawn now."""
        if self.total:
            frac = min(1.0, self.count / self.total)
            bar = "#" * int(frac * BAR_WIDTH)
            return f"{self.label}: [{bar:<{BAR_WIDTH}}] {self.count}/{self.total} {self.unit} ({frac:.0%})"
        return f"{self.label}: {self.count} {self.unit}"

    def draw(self, force: bool = False) -> None:
        """Redraw the line, unless disabled or (without ``force``) it was
        redrawn less than ``REDRAW_INTERVAL_S`` ago."""
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < REDRAW_INTERVAL_S:
            return
        self._last_draw = now
        text = self.text()
        # Padded to the widest line so far: a shorter line must not leave the
        # end of a longer one behind it.
        self._width = max(self._width, len(text))
        stream = self._stream or sys.stderr
        stream.write("\r" + text.ljust(self._width))
        stream.flush()

    def close(self) -> None:
        """Wipe the line if one was drawn."""
        if self.enabled and self._width:
            stream = self._stream or sys.stderr
            stream.write("\r" + " " * self._width + "\r")
            stream.flush()
            self._width = 0
