"""Scheduler role: look prompts up in the store and plan loads and saves.

Per request it keeps the block keys (each block hashed once, however often
vLLM asks), the vLLM block table, and how many leading blocks are known to be
stored.  Each step it turns that into a ``UCMConnectorMetadata`` plan for the
workers: which vLLM blocks to fill from which keys, and which newly full
blocks to save.  It never touches KV data.

With ``load_policy: auto`` a ``LoadPolicy`` decides how much of a stored
prefix is worth loading (``loadpolicy.py``), from what the workers measured;
hit tokens left unloaded are counted by reason, whatever the policy.

A store that fails a lookup only makes the engine hit less: the error is
counted and logged once, and the request is computed.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any

from store_backends import KVStore, StoreError

from .adapters import AdapterIdentities
from .events import EventTracker
from .hashing import BlockHasher, KeyExtras, MultiModalSpan, RequestKeys, keys_for_rank
from .counters import StatsCollector
from .loadpolicy import MIN_HIT_BLOCKS, LoadDecision, LoadPolicy, ReadSample, StepSample
from .measure import tiers_of
from .plans import BlockPlan, BlockProbe

# Under "vllm." so that vLLM's log handlers and format apply.
logger = logging.getLogger("vllm.ucm_connector.scheduler")


#: vLLM's block pool keeps block 0 as its null block: a sliding-window (or
#: chunked local attention) cache puts it where the blocks that left the
#: window were.  Its page holds nothing of the request: never saved under a
#: request's key, never loaded into.
NULL_BLOCK_ID = 0


@dataclasses.dataclass
class _RequestState:
    request: Any
    keys: RequestKeys | None
    block_ids: list[int] = dataclasses.field(default_factory=list)
    # Leading blocks found in the store or planned to be saved (a save may
    # still fail or be skipped): blocks below it are not planned again.
    num_stored_blocks: int = 0
    # (blocks asked, preemptions so far, blocks found): a lookup is reused
    # while the request waits, not after it was preempted (it may have
    # saved blocks since).
    lookup: tuple[int, int, int] | None = None
    num_local_tokens: int = 0
    pending_load: BlockPlan | None = None
    # Blocks below this index were stored or loaded before a load failure
    # made the request recompute them: their re-saves overwrite.
    overwrite_until: int = 0
    # ((lookup, blocks local), what to load of it): made once per lookup,
    # acted on (counted, probes sent) once, when the request is scheduled.
    decision: tuple[tuple, LoadDecision] | None = None
    decision_acted: bool = False
    # Multimodal inputs the keys were made with: a streaming session adds
    # inputs to a running request, and keys must then be made again.
    num_mm: int = 0


def _num_mm(request) -> int:
    return len(getattr(request, "mm_features", None) or ())


def _request_extras(request, adapters: AdapterIdentities, mm_by_content: bool = True) -> KeyExtras | None:
    """What besides its tokens enters a request's keys; ``None`` when the
    request must not share KV: its LoRA adapter cannot be identified, or a
    multimodal input of it cannot (it has no identifier or place, or the
    engine names inputs by a per-process counter: ``mm_by_content`` False)."""
    lora = getattr(request, "lora_request", None)
    lora_identity = None
    if lora is not None:
        # By the adapter's files, not its name: one name can mean two adapters.
        lora_identity = adapters.identity(lora.lora_int_id, lora.lora_path, lora.lora_name)
        if lora_identity is None:
            return None
    spans = []
    features = getattr(request, "mm_features", None) or []
    if features and not mm_by_content:
        return None
    for feature in features:
        position = getattr(feature, "mm_position", None)
        identifier = getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None)
        if position is None or identifier is None:
            return None         # keyed without it, another input's KV would match
        spans.append(MultiModalSpan(str(identifier), int(position.offset), int(position.length)))
    return KeyExtras(lora=lora_identity, cache_salt=getattr(request, "cache_salt", None), mm_spans=tuple(spans))


def _lora_name(request) -> str | None:
    lora = getattr(request, "lora_request", None)
    return None if lora is None else lora.lora_name


class UCMScheduler:
    def __init__(self, *, store: KVStore, hasher: BlockHasher, block_size: int, tp_size: int,
                 load: bool, save: bool, min_hit_blocks: int, stats: StatsCollector,
                 load_async: bool = False, events: EventTracker | None = None,
                 adapters: AdapterIdentities | None = None, policy: LoadPolicy | None = None,
                 mm_by_content: bool = True) -> None:
        self.store = store
        self.hasher = hasher
        self.block_size = block_size
        self.tp_size = tp_size
        self.load = load
        self.save = save
        self.min_hit_blocks = min_hit_blocks
        self.stats = stats
        self.load_async = load_async
        self.events = events or EventTracker(enabled=False, tp_size=tp_size, block_size=block_size)
        self.adapters = adapters or AdapterIdentities()
        self.policy = policy
        # False where vLLM names multimodal inputs by a counter, not by content.
        self.mm_by_content = mm_by_content
        self._tiers = tiers_of(store)
        self._probes: list[BlockProbe] = []
        self._states: dict[str, _RequestState] = {}
        self._logged_store_error = False
        # Block ids loaded (sync or layerwise) in this step and the one before.
        self._recent_loads: collections.deque[set[int]] = collections.deque([set(), set()], maxlen=2)

    # -- helpers -----------------------------------------------------------

    def _state(self, request) -> _RequestState:
        state = self._states.get(request.request_id)
        if state is None:
            keys = None
            if getattr(request, "prompt_embeds", None) is None:
                extras = self._extras(request)
                if extras is not None:
                    keys = self.hasher.request_for(extras)
            state = _RequestState(request=request, keys=keys, num_mm=_num_mm(request))
            self._states[request.request_id] = state
        return state

    def _extras(self, request) -> KeyExtras | None:
        return _request_extras(request, self.adapters, self.mm_by_content)

    def _keys(self, state: _RequestState) -> list[bytes]:
        """Keys of every full block of the request's tokens so far."""
        if state.keys is None:
            return []
        tokens = state.request.all_token_ids
        if _num_mm(state.request) == state.num_mm:
            try:
                return state.keys.update(tokens)
            except ValueError:
                pass
        # The token list no longer extends what was hashed (a request
        # rewritten on resume), or inputs were added to it (a streaming
        # session's next turn, whose images enter the keys): start its
        # chain again.
        extras = self._extras(state.request)
        state.keys = None if extras is None else self.hasher.request_for(extras)
        state.num_mm = _num_mm(state.request)
        state.num_stored_blocks = 0
        return [] if state.keys is None else state.keys.update(tokens)

    def _store_failed(self, what: str, exc: BaseException) -> None:
        self.stats.add(store_errors=1)
        if not self._logged_store_error:
            self._logged_store_error = True
            logger.warning("ucm-connector: %s failed: %s; running without the external cache "
                           "for now (further store errors are counted, not logged)", what, exc)

    def _stored_prefix(self, keys: list[bytes]) -> int:
        if not keys:
            return 0
        try:
            found = self.store.prefix_len(keys)
            for rank in range(1, self.tp_size):
                if found == 0:
                    break
                found = min(found, self.store.prefix_len(keys_for_rank(keys[:found], rank)))
            return found
        except StoreError as exc:
            self._store_failed("store lookup", exc)
            return 0

    def _tier_runs(self, keys: list[bytes]) -> list[tuple[int, int]]:
        """``(tier, num_blocks)`` of a stored prefix, in order: the tier a
        read of each block comes from (the first that has it).  A block
        that is also in a faster tier further on is taken as the slower
        tier's: the estimate errs toward recomputing."""
        if len(self._tiers) == 1:
            return [(0, len(keys))]
        runs: list[tuple[int, int]] = []
        pos = 0
        while pos < len(keys):
            for tier, store in enumerate(self._tiers):
                try:
                    advance = store.prefix_len(keys[pos:])
                except StoreError:
                    continue
                if advance:
                    runs.append((tier, advance))
                    pos += advance
                    break
            else:
                # Gone since the lookup: whatever is left, from the last tier.
                runs.append((len(self._tiers) - 1, len(keys) - pos))
                break
        return runs

    def _decide(self, state: _RequestState, keys: list[bytes], found: int, num_local_blocks: int) -> LoadDecision:
        """How many leading blocks the request is to have (made once per
        lookup: vLLM may ask again while the request waits)."""
        memo = (state.lookup, num_local_blocks)
        if state.decision is not None and state.decision[0] == memo:
            return state.decision[1]
        if found < self.min_hit_blocks:
            unloaded = {MIN_HIT_BLOCKS: found - num_local_blocks} if found > num_local_blocks else {}
            decision = LoadDecision(num_local_blocks, unloaded)
        elif self.policy is None or found <= num_local_blocks:
            decision = LoadDecision(max(found, num_local_blocks))
        else:
            decision = self.policy.decide(num_local_blocks, self._tier_runs(keys[:found]))
        state.decision = (memo, decision)
        state.decision_acted = False
        return decision

    def observe(self, reads: list[ReadSample], steps: list[StepSample]) -> None:
        """What the workers measured (``load_policy: auto``)."""
        if self.policy is not None:
            self.policy.observe(reads, steps)

    # -- vLLM scheduler hooks ----------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        state = self._state(request)
        if not self.load or state.keys is None:
            return 0, False
        keys = self._keys(state)
        # Always leave at least one token to compute: it yields the logits.
        max_blocks = min(len(keys), (request.num_tokens - 1) // self.block_size)
        preemptions = getattr(request, "num_preemptions", 0)
        if state.lookup is not None and state.lookup[:2] == (max_blocks, preemptions):
            found = state.lookup[2]
        else:
            found = self._stored_prefix(keys[:max_blocks])
            state.lookup = (max_blocks, preemptions, found)
            self.stats.add(lookup_tokens=max_blocks * self.block_size)
        decision = self._decide(state, keys, found, num_computed_tokens // self.block_size)
        if found < self.min_hit_blocks:
            found = 0
        state.num_stored_blocks = max(state.num_stored_blocks, found)
        num_external = decision.num_blocks * self.block_size - num_computed_tokens
        if num_external <= 0:
            return 0, False
        state.num_local_tokens = num_computed_tokens
        # Asynchronous: the request waits (its blocks allocated) until the
        # workers report the load finished, and other requests run meanwhile.
        return num_external, self.load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        state = self._state(request)
        if state.decision is not None and not state.decision_acted:
            self._act(state)
        if num_external_tokens <= 0 or state.keys is None:
            return
        block_ids = list(blocks.get_block_ids()[0])
        state.block_ids = block_ids
        first = state.num_local_tokens // self.block_size
        last = (state.num_local_tokens + num_external_tokens) // self.block_size
        real = [i for i in range(first, min(last, len(block_ids))) if block_ids[i] != NULL_BLOCK_ID]
        state.pending_load = BlockPlan(request.request_id, [block_ids[i] for i in real],
                                       [state.keys.keys[i] for i in real])
        self.stats.add(hit_tokens=num_external_tokens)

    def _act(self, state: _RequestState) -> None:
        """The request is scheduled as decided: count what it leaves
        unloaded, and send its probes."""
        state.decision_acted = True
        decision = state.decision[1]
        unloaded = {f"unloaded_hit_tokens_{reason}": n * self.block_size
                    for reason, n in decision.unloaded.items() if n > 0}
        if unloaded:
            self.stats.add(**unloaded)
        if self.policy is not None:
            keys = state.keys.keys if state.keys is not None else []
            self._probes += [BlockProbe(p.tier, keys[p.first:p.first + p.num_blocks])
                             for p in decision.probes if keys[p.first:p.first + p.num_blocks]]
            self.policy.scheduled(decision)

    def take_probes(self) -> list[BlockProbe]:
        probes, self._probes = self._probes, []
        return probes

    def build_plans(self, scheduler_output) -> tuple[list[BlockPlan], list[BlockPlan]]:
        for new in scheduler_output.scheduled_new_reqs:
            state = self._states.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, req_id in enumerate(cached.req_ids):
            state = self._states.get(req_id)
            new_ids = cached.new_block_ids[i]
            if state is None:
                continue
            if req_id in resumed:
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])

        loads = []
        for state in self._states.values():
            if state.pending_load is not None:
                if state.pending_load.block_ids:
                    loads.append(state.pending_load)
                state.pending_load = None
        # An asynchronous load is never read in the step that starts it (the
        # request waits until it is reported done, failures included).
        self._recent_loads.append(set() if self.load_async else {b for plan in loads for b in plan.block_ids})
        recent_loads = self._recent_loads[0] | self._recent_loads[1]

        saves = []
        if self.save:
            for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
                state = self._states.get(req_id)
                if state is None or state.keys is None:
                    continue
                request = state.request
                num_done = min(request.num_computed_tokens + num_scheduled, request.num_tokens)
                num_full = min(num_done // self.block_size, len(state.block_ids))
                if num_full <= state.num_stored_blocks:
                    continue
                keys = self._keys(state)
                num_full = min(num_full, len(keys))
                first = state.num_stored_blocks
                blocks = state.block_ids
                while first < num_full and blocks[first] == NULL_BLOCK_ID:
                    first += 1          # left the window: their KV is gone
                if NULL_BLOCK_ID in blocks[first:num_full]:
                    num_full = blocks.index(NULL_BLOCK_ID, first, num_full)
                if num_full > first:
                    # The pages this step's computation reads (the blocks
                    # before its first token) that came from the store lately.
                    inputs = state.block_ids[:request.num_computed_tokens // self.block_size]
                    loaded_inputs = [b for b in inputs if b in recent_loads] if recent_loads else []
                    saves.append(BlockPlan(req_id, state.block_ids[first:num_full], keys[first:num_full],
                                           loaded_inputs=loaded_inputs,
                                           overwrite=first < state.overwrite_until))
                    if self.events.enabled:
                        self.events.planned(keys[first:num_full], request.all_token_ids, first,
                                            keys[first - 1] if first else None,
                                            _lora_name(request))
                    state.num_stored_blocks = num_full
        return loads, saves

    def on_load_errors(self, block_ids: set[int]) -> None:
        """Blocks that failed to load were dropped from the store (the
        workers delete bad ones) and are being recomputed: save them again
        once they are, rather than leave a hole in the stored prefix.  The
        re-saves overwrite: from the failed block on, nothing the store
        holds under those keys is trusted to survive."""
        for state in self._states.values():
            for i, block_id in enumerate(state.block_ids[:state.num_stored_blocks]):
                if block_id in block_ids:
                    state.overwrite_until = max(state.overwrite_until, state.num_stored_blocks)
                    state.num_stored_blocks = i
                    state.lookup = None
                    break

    def request_finished(self, request) -> None:
        self._states.pop(request.request_id, None)

    def new_generation(self) -> None:
        """vLLM reset the connector's cache (``reset_prefix_cache(reset_connector=True)``,
        as after a weight update): nothing stored so far may be loaded, and
        KV made from now on must not be stored where earlier KV was looked
        for.  Keys from now on are of a new generation.  A request with no
        KV yet (waiting, or preempted by the reset) is keyed afresh; one
        that has KV, or is loading it, made it before the reset: it neither
        loads nor saves any more."""
        self.hasher = self.hasher.next_generation()
        for state in self._states.values():
            request = state.request
            fresh = (request.num_computed_tokens == 0
                     and getattr(request.status, "name", None) != "WAITING_FOR_REMOTE_KVS")
            extras = self._extras(request) if state.keys is not None and fresh else None
            state.keys = None if extras is None else self.hasher.request_for(extras)
            state.num_stored_blocks = state.overwrite_until = 0
            state.lookup = state.decision = None
            state.decision_acted = False
