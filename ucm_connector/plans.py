"""The plans a scheduler step sends to every worker: which vLLM blocks to
fill from which keys, and which to save.  Small and picklable; knows nothing
of vLLM.
"""

from __future__ import annotations

import dataclasses

from .hashing import BlockKey


@dataclasses.dataclass
class BlockPlan:
    """Blocks of one request to load or save: ``block_ids[i]`` <-> ``keys[i]``
    (TP rank 0's keys; each worker derives its own rank's).

    Saves only: ``loaded_inputs`` are the blocks this step's computation of
    the request reads that were loaded from the store in this step or the
    one before (whose outcome the scheduler may not know yet); if any of
    them failed to load, the KV computed on top of it is wrong and the
    worker drops the save.  ``overwrite``: the blocks are saved again after
    a load failure, so whatever the store holds under their keys is
    replaced rather than kept.
    """

    req_id: str
    block_ids: list[int]
    keys: list[BlockKey]
    loaded_inputs: list[int] = dataclasses.field(default_factory=list)
    overwrite: bool = False


@dataclasses.dataclass
class BlockProbe:
    """Blocks to read from one tier of the store in the background, for the
    timing only (``load_policy: auto`` measuring a tier it does not load
    from): ``keys`` are TP rank 0's, as in ``BlockPlan``."""

    tier: int
    keys: list[bytes]
