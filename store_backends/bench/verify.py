"""Every way the store disagreed with what was put.

Owns the checks made after each phase, outside the clock: each put
accepted, each get hit and returned the very bytes put (compared in slabs),
contains and prefix_len answered right.  A failure names the round, the
key and the block.  Must not time anything or change the store.
"""

from __future__ import annotations

import numpy as np

from .phases import PhaseResult


class Verifier:
    """Collects every way the store disagreed with what was put."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.num_misses = 0

    @property
    def ok(self) -> bool:
        return not self.failures

    def _answers(self, result: PhaseResult, what: str, round_label: str, keys: list[bytes]):
        for call, answer in result.returns:
            if not isinstance(answer, (list, tuple)) or len(answer) != call.num_keys:
                self.failures.append(
                    f"round {round_label}: {what} of {call.num_keys} keys from block {call.first} "
                    f"returned {type(answer).__name__} {str(answer)[:60]}, not one bool per key")
                continue
            for j, flag in enumerate(answer):
                yield call.first + j, bool(flag)

    def check_put(self, result: PhaseResult, round_label: str, keys: list[bytes]) -> None:
        for block, ok in self._answers(result, "put", round_label, keys):
            if not ok:
                self.failures.append(f"round {round_label}: put refused key {keys[block]!r} (block {block})")

    def check_contains(self, result: PhaseResult, round_label: str, keys: list[bytes]) -> None:
        for block, ok in self._answers(result, "contains", round_label, keys):
            if not ok:
                self.num_misses += 1
                self.failures.append(
                    f"round {round_label}: contains says key {keys[block]!r} (block {block}) is missing after put")

    def check_prefix_len(self, result: PhaseResult, round_label: str, keys: list[bytes]) -> None:
        for call, answer in result.returns:
            if answer != call.num_keys:
                first_missing = answer if isinstance(answer, int) and 0 <= answer < len(keys) else None
                named = (f"; key {keys[first_missing]!r} (block {first_missing}) is the first it does not see"
                         if first_missing is not None else "")
                self.failures.append(
                    f"round {round_label}: prefix_len over {call.num_keys} stored keys returned {answer!r}{named}")

    def check_get(self, result: PhaseResult, round_label: str, keys: list[bytes],
                  values: np.ndarray, dest: np.ndarray) -> None:
        hit = np.zeros(len(keys), dtype=bool)
        for block, ok in self._answers(result, "get_into", round_label, keys):
            hit[block] = ok
            if not ok:
                self.num_misses += 1
                self.failures.append(
                    f"round {round_label}: get missed key {keys[block]!r} (block {block}) after a successful put")
        # Compare in slabs so a large run does not double its memory for the mask.
        rows_per_slab = max(1, (64 << 20) // max(values.shape[1], 1))
        for lo in range(0, len(keys), rows_per_slab):
            hi = min(lo + rows_per_slab, len(keys))
            differs = (dest[lo:hi] != values[lo:hi]).any(axis=1)
            for offset in np.flatnonzero(differs & hit[lo:hi]):
                block = lo + int(offset)
                wrong = dest[block] != values[block]
                self.failures.append(
                    f"round {round_label}: get returned wrong bytes for key {keys[block]!r} (block {block}): "
                    f"{int(wrong.sum())} of {values.shape[1]} bytes differ, first at offset {int(np.argmax(wrong))}")
