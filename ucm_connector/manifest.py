"""Namespace manifests: what a namespace digest stands for, kept in the store.

A block's header names its namespace only by a 16-byte digest (blockfmt), and
a digest cannot be turned back into "SmolLM2-135M, bf16, CPU vec layout,
block 128, TP rank 0 of 1". So each engine rank that uses a store leaves one
small record there, under a key of its own, that spells out the ``Namespace``
behind its digest; ``ucm store stats`` and ``ucm store clear --namespace``
read it to show and select namespaces by model.

This module owns the manifest key and its JSON. It knows nothing of vLLM
(the connector hands it a ``Namespace``) and writes nothing else. A manifest
is a convenience for operators: failing to write one never stops an engine.

Key: ``b"ucm-manifest:" + digest`` (29 bytes). Block keys are 18 bytes
(hashing.KEY_NBYTES), so the two never collide, and any tool that walks a
store can tell a manifest from a block by its key alone.

Value: canonical JSON (sorted keys, no spaces), for example::

    {"created": 1735689600.0, "digest": "<32 hex>", "kind": "ucm-namespace-manifest",
     "manifest_version": 1, "model_name": "models/smollm2-135m",
     "namespace": {"block_size": 128, "dtype": "bfloat16", ...},
     "writer": {"host": "node-1", "ucm_connector": "0.1.0"}}

``namespace`` is ``dataclasses.asdict(Namespace)``; a reader recomputes the
digest from it, so a manifest stored under the wrong key, or damaged into
another valid JSON, is caught rather than believed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import time
from typing import Iterable

from .hashing import Namespace

# Under "vllm." so that vLLM's log handlers and format apply when the
# connector calls in; no vLLM import is needed for that.
logger = logging.getLogger("vllm.ucm_connector.manifest")

MANIFEST_PREFIX = b"ucm-manifest:"
MANIFEST_KIND = "ucm-namespace-manifest"
MANIFEST_VERSION = 1
DIGEST_NBYTES = 16
#: A manifest is a few hundred bytes; anything far larger is not one.
MAX_MANIFEST_NBYTES = 64 << 10


class ManifestError(ValueError):
    """A stored manifest that cannot be used; the message says why."""


def manifest_key(digest: bytes) -> bytes:
    """The store key of the manifest of namespace ``digest``."""
    if len(digest) != DIGEST_NBYTES:
        raise ValueError(f"a namespace digest has {DIGEST_NBYTES} bytes, got {len(digest)}")
    return MANIFEST_PREFIX + bytes(digest)


def is_manifest_key(key: bytes) -> bool:
    return len(key) == len(MANIFEST_PREFIX) + DIGEST_NBYTES and key.startswith(MANIFEST_PREFIX)


def digest_of(key: bytes) -> bytes:
    """The namespace digest a manifest key is for."""
    if not is_manifest_key(key):
        raise ValueError(f"{bytes(key)!r} is not a manifest key")
    return bytes(key[len(MANIFEST_PREFIX):])


def encode_manifest(namespace: Namespace, model_name: str | None = None,
                    created: float | None = None) -> bytes:
    """The stored value of ``namespace``'s manifest."""
    from . import __version__

    record = {
        "kind": MANIFEST_KIND,
        "manifest_version": MANIFEST_VERSION,
        "digest": namespace.digest.hex(),
        "namespace": dataclasses.asdict(namespace),
        "model_name": None if model_name is None else str(model_name),
        "created": time.time() if created is None else float(created),
        "writer": {"ucm_connector": __version__, "host": socket.gethostname()},
    }
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def parse_manifest(value: bytes, digest: bytes | None = None) -> dict:
    """The manifest in ``value`` as a dict; ``ManifestError`` when it is not
    one, or (given ``digest``) describes another namespace. A manifest from
    a newer build with namespace fields this one does not know is accepted
    unchecked: its ``namespace`` cannot be hashed here."""
    if len(value) > MAX_MANIFEST_NBYTES:
        raise ManifestError(f"{len(value)} bytes is too large for a manifest")
    try:
        record = json.loads(bytes(value).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"not valid JSON ({exc})") from None
    if not isinstance(record, dict) or record.get("kind") != MANIFEST_KIND:
        raise ManifestError("not a ucm namespace manifest")
    fields = record.get("namespace")
    if not isinstance(fields, dict):
        raise ManifestError("it has no namespace fields")
    known = {f.name for f in dataclasses.fields(Namespace)}
    if set(fields) <= known:
        try:
            actual = Namespace(**fields).digest
        except (TypeError, ValueError) as exc:
            raise ManifestError(f"its namespace fields are invalid ({exc})") from None
        if digest is not None and actual != bytes(digest):
            raise ManifestError(
                f"it describes namespace {actual.hex()}, but is stored for {bytes(digest).hex()}")
    return record


def describe(record: dict) -> str:
    """One line for ``ucm store stats``: model, dtype, layout, geometry, rank."""
    ns = record.get("namespace") or {}
    model = record.get("model_name") or f"model {str(ns.get('model_fingerprint', '?'))[:12]}"
    extra = "".join(f", {k}={v}" for k, v in (ns.get("extra") or ()))
    return (f"{model} {ns.get('dtype', '?')} {ns.get('kv_layout', '?')}, block {ns.get('block_size', '?')}, "
            f"{ns.get('num_layers', '?')} layers x {ns.get('num_kv_heads', '?')} kv heads x "
            f"{ns.get('head_size', '?')}, tp {ns.get('tp_rank', '?')}/{ns.get('tp_size', '?')}, "
            f"format v{ns.get('format_version', '?')}{extra}")


def write_manifest(store, namespace: Namespace, model_name: str | None = None) -> bool:
    """Make sure ``store`` holds the manifest of ``namespace``.

    An existing manifest is read (which, in stores with LRU eviction, counts
    as a use and keeps it from being evicted before the blocks it describes)
    and kept as it is, with its first creation time; a missing one is
    written. Returns whether the store holds it afterwards. Never raises:
    a store that is down or full only means no manifest.
    """
    key = manifest_key(namespace.digest)
    try:
        if store.get([key])[0] is not None:
            return True
        return bool(store.put([key], [encode_manifest(namespace, model_name)])[0])
    except Exception as exc:  # any store, third-party ones included: never the engine's problem
        logger.warning("ucm-connector: could not write the namespace manifest to %s: %s "
                       "(`ucm store stats` will show this namespace by digest only)",
                       getattr(store, "url", store), exc)
        return False


def read_manifests(store, digests: Iterable[bytes]) -> dict[bytes, dict]:
    """The sound manifests among ``digests``, by digest. Missing and unusable
    ones are left out (``ucm store verify`` reports the unusable ones).
    Store errors propagate: the caller is an operator tool that should say so."""
    digests = list(dict.fromkeys(bytes(d) for d in digests))
    found: dict[bytes, dict] = {}
    for start in range(0, len(digests), 500):
        part = digests[start:start + 500]
        for digest, got in zip(part, store.peek([manifest_key(d) for d in part], None)):
            if got is None:
                continue
            try:
                found[digest] = parse_manifest(got[1], digest)
            except ManifestError:
                continue
    return found
