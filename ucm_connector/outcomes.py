"""What became of each block a worker was asked to save or found bad:
recorded by the worker, carried to the scheduler, turned into KV events
there (``events.py``).  Knows nothing of vLLM.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

WRITTEN, PRESENT, NOT_STORED, REMOVED = "written", "present", "not_stored", "removed"


class OutcomeLog:
    """Worker side: outcomes recorded by the engine thread and the background
    writer, handed over once per step."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()
        self._outcomes: list[tuple[str, bytes]] = []

    def add(self, outcome: str, keys: Sequence[bytes]) -> None:
        if self.enabled and keys:
            with self._lock:
                self._outcomes.extend((outcome, key) for key in keys)

    def take(self) -> list[tuple[str, bytes]] | None:
        """The ``(outcome, key)`` pairs since the last take, or None."""
        if not self.enabled:
            return None
        with self._lock:
            if not self._outcomes:
                return None
            outcomes, self._outcomes = self._outcomes, []
        return outcomes
