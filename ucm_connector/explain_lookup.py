"""``ucm explain``'s view of a store: the namespaces its manifests record,
and what it holds of one prompt under each.

Owns finding every deployment (a namespace with the ranks whose manifest is
stored) from the store's manifests, computing the prompt's block keys under
a deployment's namespace (with the request's cache_salt and LoRA adapter),
asking the store which of them it holds for every TP rank, and the hit the
scheduler would answer from that (``Lookup``); and how two namespaces
differ, field by field.

What it must not do: change the store (keys are listed and asked
``contains``, manifests are peeked), decide which namespace is the engine's
or why a block misses (``explain.py``, ``explain_reasons.py``), or import
vLLM or torch.  A namespace whose manifest is gone is not seen.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

from store_backends import StoreError

from .adapters import adapter_identity, lora_settings
from .cli.output import UserError
from .hashing import BlockHasher, Namespace, adapter_fingerprint, keys_for_rank
from .manifest import Manifest, NewerManifestError, describe, digest_of, is_manifest_key, read_manifests

_CONTAINS_BATCH = 1000


@dataclasses.dataclass(frozen=True)
class Deployment:
    """One deployment's namespace as its manifests record it: the namespace
    of rank 0 (all ranks share one key chain) and the ranks whose manifest
    the store holds."""

    namespace: Namespace       # rank 0's
    model_name: str | None
    digests: tuple[bytes, ...]
    created: float

    @property
    def digest(self) -> bytes:
        return self.namespace.digest

    def describe(self) -> str:
        return describe(self, tp=f"tp size {self.namespace.tp_size}")

    def to_dict(self) -> dict:
        return {"digest": self.digest.hex(), "rank_digests": [d.hex() for d in self.digests],
                "model_name": self.model_name, "description": self.describe(),
                "namespace": {k: (list(map(list, v)) if k == "extra" else v)
                              for k, v in dataclasses.asdict(self.namespace).items() if k != "tp_rank"}}


def find_deployments(store) -> tuple[list[Deployment], int]:
    """Every deployment whose manifests the store holds, and how many
    manifests could not be read."""
    try:
        digests = [digest_of(key) for batch in store.iter_keys(1000) for key in batch if is_manifest_key(key)]
    except StoreError as exc:
        raise StoreError(f"{exc} (ucm explain lists the store's keys to find its namespace manifests)") from None
    groups: dict[bytes, list] = {}
    unreadable = 0
    for digest, manifest in read_manifests(store, digests).items():
        if not isinstance(manifest, Manifest):
            unreadable += not isinstance(manifest, NewerManifestError)
            continue
        rank0 = manifest.namespace.for_rank(0)
        groups.setdefault(rank0.digest, []).append(manifest)
    deployments = []
    for manifests in groups.values():
        manifests.sort(key=lambda m: m.namespace.tp_rank)
        deployments.append(Deployment(
            namespace=manifests[0].namespace.for_rank(0),
            model_name=next((m.model_name for m in manifests if m.model_name), None),
            digests=tuple(m.digest for m in manifests),
            created=max(m.created for m in manifests)))
    deployments.sort(key=lambda d: d.digest)
    return deployments, unreadable


@dataclasses.dataclass(frozen=True)
class Block:
    """One full block of the prompt under one namespace."""

    index: int
    start: int                          # tokens [start, end)
    end: int
    loadable: bool                      # within the scheduler's cap
    stored_ranks: tuple[int, ...]
    tp_size: int

    @property
    def stored(self) -> bool:
        return len(self.stored_ranks) == self.tp_size

    @property
    def missing_ranks(self) -> list[int]:
        return [r for r in range(self.tp_size) if r not in self.stored_ranks]

    def to_dict(self) -> dict:
        return {"index": self.index, "start": self.start, "end": self.end, "stored": self.stored,
                "loadable": self.loadable, "missing_ranks": self.missing_ranks}


@dataclasses.dataclass(frozen=True)
class Lookup:
    """What a request for the prompt would find under one deployment's namespace."""

    deployment: Deployment
    with_salt: bool
    with_lora: bool
    blocks: tuple[Block, ...]
    max_blocks: int                     # the scheduler's cap: (num_tokens - 1) // block_size
    leading_blocks: int                 # leading loadable blocks stored on every rank
    hit_blocks: int                     # after min_hit_blocks

    @property
    def block_size(self) -> int:
        return self.deployment.namespace.block_size

    @property
    def hit_tokens(self) -> int:
        return self.hit_blocks * self.block_size

    @property
    def held_tokens(self) -> int:
        """Leading tokens of the prompt stored here, whether loadable or not."""
        n = 0
        for block in self.blocks:
            if not block.stored:
                break
            n = block.end
        return n


@functools.lru_cache(maxsize=4)
def _adapter_fingerprint(lora_dir: str) -> str:
    try:
        return adapter_fingerprint(lora_dir)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot fingerprint the LoRA adapter {lora_dir!r}: {exc}") from None


def _lora_identity(lora_dir: str, dtype: str) -> str:
    """The adapter's identity in an engine of ``dtype`` with vLLM's LoRA
    defaults (``--lora-dtype auto``, no ``target_modules`` restriction)."""
    return adapter_identity(_adapter_fingerprint(lora_dir), lora_settings(dtype=dtype))


def look_up(store, deployment: Deployment, token_ids: Sequence[int], *, cache_salt: str | None,
            lora_dir: str | None, min_hit_blocks: int) -> Lookup:
    """The prompt's blocks under ``deployment``, present on which ranks."""
    ns = deployment.namespace
    lora = _lora_identity(lora_dir, ns.dtype) if lora_dir is not None else None
    keys = BlockHasher(ns).block_keys(token_ids, lora=lora, cache_salt=cache_salt)
    stored_ranks: list[list[int]] = [[] for _ in keys]
    for rank in range(ns.tp_size):
        rank_keys = keys_for_rank(keys, rank)
        for first in range(0, len(keys), _CONTAINS_BATCH):
            part = rank_keys[first:first + _CONTAINS_BATCH]
            for i, present in enumerate(store.contains(part), first):
                if present:
                    stored_ranks[i].append(rank)
    bs = ns.block_size
    max_blocks = min(len(keys), max(0, (len(token_ids) - 1) // bs))
    blocks = tuple(Block(i, i * bs, (i + 1) * bs, i < max_blocks, tuple(ranks), ns.tp_size)
                   for i, ranks in enumerate(stored_ranks))
    leading = 0
    while leading < max_blocks and blocks[leading].stored:
        leading += 1
    return Lookup(deployment, cache_salt is not None, lora_dir is not None, blocks, max_blocks, leading,
                  leading if leading >= min_hit_blocks else 0)


# -- how namespaces differ ---------------------------------------------------------

# Namespace fields as a report names them, in the order they are compared.
_FIELDS = (("model_fingerprint", "model weights"), ("dtype", "dtype"), ("kv_layout", "KV layout"),
           ("block_size", "block size"), ("num_layers", "layers"), ("num_kv_heads", "kv heads"),
           ("head_size", "head size"), ("tp_size", "TP size"), ("format_version", "block format version"),
           ("extra", "extra fields"))


def differences(this: dict, other) -> list[dict]:
    """The namespace fields in which ``other`` (a Namespace) differs from
    ``this`` (field -> value: a whole namespace, or what the user selected)."""
    out = []
    for field, label in _FIELDS:
        if field not in this:
            continue
        mine, theirs = this[field], getattr(other, field)
        if mine != theirs:
            out.append({"field": field, "label": label, "this": _jsonable(mine), "other": _jsonable(theirs)})
    return out


def _jsonable(value):
    return [list(pair) for pair in value] if isinstance(value, tuple) else value


def namespace_fields(ns) -> dict:
    """The fields ``differences`` compares, of the Namespace ``ns``."""
    return {field: getattr(ns, field) for field, _ in _FIELDS}


def say_differences(diffs: list[dict]) -> str:
    """``differences`` in words, for a report."""
    def short(field, value):
        return str(value)[:12] if field == "model_fingerprint" else str(value)

    return "; ".join(f"{d['label']} {short(d['field'], d['other'])} (this engine: {short(d['field'], d['this'])})"
                     for d in diffs) or "no field of the selection"


def say_selection(selection: dict) -> str:
    """The namespace fields the user selected, in words ("dtype float32, block size 64")."""
    return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in selection.items())
