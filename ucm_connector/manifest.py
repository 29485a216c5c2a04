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

Reading is strict, because the bytes come from a store anyone on the network
may have written and ``ucm`` must neither crash on them nor show them as
fact: a version-1 manifest is accepted only when it is exactly what
``encode_manifest`` writes for a valid ``Namespace`` (every field present,
none unknown, each of its type, integers within the 64 bits the digest
encodes them in, canonical JSON). Anything else is a ``ManifestError``
("bad manifest": ``ucm store verify --repair`` removes it), except a higher
``manifest_version``, which is a ``NewerManifestError``: written by a newer
build, left alone. A newer build that changes the fields raises the version.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import socket
import struct
import time
from typing import Iterable

from .blockfmt import DIGEST_NBYTES
from .hashing import Namespace

# Under "vllm." so that vLLM's log handlers and format apply when the
# connector calls in; no vLLM import is needed for that.
logger = logging.getLogger("vllm.ucm_connector.manifest")

MANIFEST_PREFIX = b"ucm-manifest:"
MANIFEST_KIND = "ucm-namespace-manifest"
MANIFEST_VERSION = 1
#: A manifest is a few hundred bytes; anything far larger is not one.
MAX_MANIFEST_NBYTES = 64 << 10


class ManifestError(ValueError):
    """A stored manifest that cannot be used; the message says why."""


class NewerManifestError(ManifestError):
    """A manifest of a version this build does not read: not damage, so it
    is neither shown nor removed."""


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A sound manifest: the namespace behind a digest, and who wrote it."""

    namespace: Namespace
    model_name: str | None
    created: float
    writer_version: str
    writer_host: str

    @property
    def digest(self) -> bytes:
        return self.namespace.digest

    def to_dict(self) -> dict:
        """The stored record (what ``ucm store stats --json`` shows)."""
        return {
            "kind": MANIFEST_KIND,
            "manifest_version": MANIFEST_VERSION,
            "digest": self.digest.hex(),
            "namespace": dataclasses.asdict(self.namespace),
            "model_name": self.model_name,
            "created": self.created,
            "writer": {"ucm_connector": self.writer_version, "host": self.writer_host},
        }

    def encode(self) -> bytes:
        return _canonical(self.to_dict())


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


def _canonical(record: dict) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


def encode_manifest(namespace: Namespace, model_name: str | None = None,
                    created: float | None = None) -> bytes:
    """The stored value of ``namespace``'s manifest."""
    from . import __version__

    return Manifest(namespace, None if model_name is None else str(model_name),
                    time.time() if created is None else float(created), __version__,
                    socket.gethostname()).encode()


_RECORD_FIELDS = frozenset({"kind", "manifest_version", "digest", "namespace", "model_name", "created",
                            "writer"})
_WRITER_FIELDS = frozenset({"ucm_connector", "host"})
# "int", "str", ...: annotations are strings under `from __future__ import annotations`.
_NAMESPACE_TYPES = {f.name: f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
                    for f in dataclasses.fields(Namespace)}
_INT64 = range(-(1 << 63), 1 << 63)


def _refuse_constant(name: str) -> float:
    raise ManifestError(f"it holds {name}, which is not a number")


def _check_fields(what: str, found: dict, expected: frozenset) -> None:
    unknown = sorted(set(found) - expected)
    missing = sorted(expected - set(found))
    if unknown:
        raise ManifestError(f"unknown {what} field(s) {', '.join(map(repr, unknown))}")
    if missing:
        raise ManifestError(f"missing {what} field(s) {', '.join(map(repr, missing))}")


def _namespace_of(fields: object) -> Namespace:
    if not isinstance(fields, dict):
        raise ManifestError("its namespace is not an object")
    _check_fields("namespace", fields, frozenset(_NAMESPACE_TYPES))
    for name, value in fields.items():
        kind = _NAMESPACE_TYPES[name]
        if kind == "int":
            # bool is an int to Python but not to a manifest; the digest
            # packs integers in 64 bits, so a larger one cannot name a namespace.
            if type(value) is not int or value not in _INT64:
                raise ManifestError(f"namespace field {name!r} is not a 64-bit integer")
        elif kind == "str":
            if type(value) is not str:
                raise ManifestError(f"namespace field {name!r} is not a string")
        elif name == "extra":
            if not (isinstance(value, list) and all(
                    isinstance(pair, list) and len(pair) == 2 and all(type(v) is str for v in pair)
                    for pair in value)):
                raise ManifestError(f"namespace field {name!r} is not a list of [name, value] strings")
        # A field of another type is left to Namespace's own checks and the
        # canonical round trip in parse_manifest.
    try:
        namespace = Namespace(**fields)
        namespace.digest
    except (TypeError, ValueError, OverflowError, struct.error) as exc:
        raise ManifestError(f"its namespace fields are invalid ({exc})") from None
    return namespace


def parse_manifest(value: bytes, digest: bytes | None = None) -> Manifest:
    """The manifest in ``value``; ``ManifestError`` when it is not exactly
    one (see the module docstring), or, given ``digest``, when it describes
    another namespace. Never raises anything else, whatever ``value`` is."""
    value = bytes(value)
    if len(value) > MAX_MANIFEST_NBYTES:
        raise ManifestError(f"{len(value)} bytes is too large for a manifest")
    try:
        record = json.loads(value.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"not valid JSON ({exc})") from None
    except RecursionError:
        raise ManifestError("not valid JSON (nested too deeply)") from None
    except ValueError as exc:  # an integer of more digits than int() accepts
        raise ManifestError(f"not valid JSON ({str(exc)[:80]})") from None
    if not isinstance(record, dict) or record.get("kind") != MANIFEST_KIND:
        raise ManifestError("not a ucm namespace manifest")
    version = record.get("manifest_version")
    if type(version) is not int:
        raise ManifestError("its manifest_version is not an integer")
    if version > MANIFEST_VERSION:
        raise NewerManifestError(
            f"manifest version {version} is newer than this build reads ({MANIFEST_VERSION}): "
            f"upgrade ucm-connector to read it")
    if version != MANIFEST_VERSION:
        raise ManifestError(f"unsupported manifest version {version}")
    _check_fields("top-level", record, _RECORD_FIELDS)
    namespace = _namespace_of(record["namespace"])
    model_name, created, writer = record["model_name"], record["created"], record["writer"]
    if model_name is not None and type(model_name) is not str:
        raise ManifestError("its model_name is not a string")
    if type(created) is not float or not math.isfinite(created):
        raise ManifestError("its created time is not a finite number")
    if not isinstance(writer, dict):
        raise ManifestError("its writer is not an object")
    _check_fields("writer", writer, _WRITER_FIELDS)
    if not all(type(v) is str for v in writer.values()):
        raise ManifestError("its writer fields are not strings")
    manifest = Manifest(namespace, model_name, created, writer["ucm_connector"], writer["host"])
    if record["digest"] != manifest.digest.hex():
        # Not quoted: it may be anything, a nesting too deep to print included.
        raise ManifestError(f"its digest is not that of its namespace ({manifest.digest.hex()})")
    if digest is not None and manifest.digest != bytes(digest):
        raise ManifestError(
            f"it describes namespace {manifest.digest.hex()}, but is stored for {bytes(digest).hex()}")
    # Last, so that the reasons above are named: the same record written
    # otherwise (spaces, key order, a repeated key, 1 for 1.0) is not what
    # any engine writes, so it was damaged or forged.
    if manifest.encode() != value:
        raise ManifestError("it is not in the canonical form engines write")
    return manifest


def describe(manifest: Manifest, tp: str | None = None) -> str:
    """One line for ``ucm store stats``: model, dtype, layout, geometry, rank
    (``tp`` says something else of the TP rank; ``manifest``: anything with
    a ``namespace`` and a ``model_name``)."""
    ns = manifest.namespace
    model = manifest.model_name or f"model {ns.model_fingerprint[:12]}"
    extra = "".join(f", {k}={v}" for k, v in ns.extra)
    return (f"{model} {ns.dtype} {ns.kv_layout}, block {ns.block_size}, "
            f"{ns.num_layers} layers x {ns.num_kv_heads} kv heads x {ns.head_size}, "
            f"{tp or f'tp {ns.tp_rank}/{ns.tp_size}'}, format v{ns.format_version}{extra}")


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


def read_manifests(store, digests: Iterable[bytes]) -> dict[bytes, Manifest | ManifestError]:
    """The manifests of ``digests`` that the store holds, by digest: a
    ``Manifest``, or the ``ManifestError`` that says why it cannot be used.
    Missing ones are left out. Store errors propagate: the caller is an
    operator tool that should say so."""
    digests = list(dict.fromkeys(bytes(d) for d in digests))
    found: dict[bytes, Manifest | ManifestError] = {}
    for start in range(0, len(digests), 500):
        part = digests[start:start + 500]
        for digest, got in zip(part, store.peek([manifest_key(d) for d in part], None)):
            if got is None:
                continue
            try:
                found[digest] = parse_manifest(got[1], digest)
            except ManifestError as exc:
                found[digest] = exc
    return found
