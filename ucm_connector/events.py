"""KV events: tell a router which blocks this engine put into, or removed
from, the external store, through vLLM's own event publisher
(``--kv-events-config``; ZMQ).

The workers know what they wrote; only the scheduler knows the tokens of a
block and may publish (vLLM collects ``take_events`` there).  So each worker
reports one outcome per planned block key (written, already present, not
stored, or removed as bad) in ``UCMKVEvents``, which vLLM carries to the
scheduler with the step's output; ``EventTracker`` counts the outcomes of
every TP rank and turns a block that all ranks hold, and at least one of them
wrote, into a ``BlockStored`` with its tokens and parent.  A bad block that
a worker deleted becomes a ``BlockRemoved``.

Block hashes in the events are the blocks' 16-byte content digests (the key
without its TP-rank suffix): the same in every engine and on every host, so a
router can match the events of many engines.  Blocks that the store itself
evicts (LRU) are not reported: no engine sees them go.

Only active when vLLM's KV events are enabled; otherwise nothing is
recorded.  Knows vLLM's event types and the connector's keys, nothing of
stores or KV data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents

from .hashing import key_digest

MEDIUM = "STORAGE"   # vLLM's name for a medium outside the engine

from .outcomes import NOT_STORED, PRESENT, REMOVED, WRITTEN, OutcomeLog  # noqa: F401  (re-exported)


def events_enabled(vllm_config) -> bool:
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and getattr(config, "enable_kv_cache_events", False))


class UCMKVEvents(KVConnectorKVEvents):
    """Block outcomes of one or more workers, ``(outcome, key)`` pairs,
    carried from the workers to the scheduler (picklable)."""

    def __init__(self, outcomes: list[tuple[str, bytes]] | None = None, num_workers: int = 1) -> None:
        self.outcomes = list(outcomes or [])
        self.num_workers = num_workers

    def add_events(self, events: list) -> None:
        self.outcomes.extend(events)

    def aggregate(self) -> "UCMKVEvents":
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.num_workers += count

    def get_all_events(self) -> list:
        return list(self.outcomes)

    def get_number_of_workers(self) -> int:
        return self.num_workers

    def clear_events(self) -> None:
        self.outcomes = []


@dataclasses.dataclass
class _Planned:
    parent: bytes | None
    token_ids: list[int]
    lora_name: str | None
    outcomes: list[str] = dataclasses.field(default_factory=list)


class EventTracker:
    """Scheduler side: what was planned for saving, and what the workers
    report about it; ``take`` yields vLLM events."""

    def __init__(self, *, enabled: bool, tp_size: int, block_size: int) -> None:
        self.enabled = enabled
        self.tp_size = tp_size
        self.block_size = block_size
        self._planned: dict[bytes, _Planned] = {}
        self._ready: list[tuple[bytes, _Planned]] = []
        self._removed: list[bytes] = []

    def planned(self, keys: Sequence[bytes], token_ids: Sequence[int], first_block: int,
                parent: bytes | None, lora_name: str | None) -> None:
        """``keys`` are blocks ``first_block...`` of a request with
        ``token_ids``; ``parent`` is the key before them (None at the start)."""
        if not self.enabled:
            return
        bs = self.block_size
        for i, key in enumerate(keys):
            block = first_block + i
            digest = key_digest(key)
            if digest not in self._planned:
                self._planned[digest] = _Planned(
                    key_digest(parent) if parent is not None else None,
                    list(token_ids[block * bs:(block + 1) * bs]), lora_name)
            parent = key

    def report(self, events: UCMKVEvents | None) -> None:
        if not self.enabled or events is None:
            return
        for outcome, key in events.get_all_events():
            digest = key_digest(key)
            if outcome == REMOVED:
                self._removed.append(digest)
                continue
            planned = self._planned.get(digest)
            if planned is None:
                continue
            planned.outcomes.append(outcome)
            if len(planned.outcomes) >= self.tp_size:
                del self._planned[digest]
                if WRITTEN in planned.outcomes and NOT_STORED not in planned.outcomes:
                    self._ready.append((digest, planned))

    def take(self) -> list[KVCacheEvent]:
        if not self.enabled or not (self._ready or self._removed):
            return []
        out: list[KVCacheEvent] = []
        if self._removed:
            out.append(BlockRemoved(block_hashes=list(dict.fromkeys(self._removed)), medium=MEDIUM))
            self._removed = []
        # Blocks of one chain, in order, become one event (as vLLM's own
        # block pool reports them).
        run: list[tuple[bytes, _Planned]] = []
        for digest, planned in self._ready:
            if run and (planned.parent != run[-1][0] or planned.lora_name != run[0][1].lora_name):
                out.append(self._stored(run))
                run = []
            run.append((digest, planned))
        if run:
            out.append(self._stored(run))
        self._ready = []
        return out

    def _stored(self, run: list[tuple[bytes, _Planned]]) -> BlockStored:
        return BlockStored(
            block_hashes=[digest for digest, _ in run],
            parent_block_hash=run[0][1].parent,
            token_ids=[t for _, planned in run for t in planned.token_ids],
            block_size=self.block_size,
            lora_id=None,
            medium=MEDIUM,
            lora_name=run[0][1].lora_name)
