"""Which LoRA adapter a request runs with, as its block keys must say it.

A request's keys cover its adapter by a fingerprint of the adapter's files
(``hashing.adapter_fingerprint``), never by its name or path: in a store that
outlives engines and is shared between them, one name can mean different
weights (a retrained adapter redeployed under its old name, two deployments
naming different adapters alike), and one adapter can live under several
paths. This module turns (adapter id, path) into that identity, once per
adapter and cheaply after that, in the scheduler process. It knows files and
how vLLM caches adapters; it does not import vLLM, torch or the stores.

Cost. Hashing reads up to ``FULL_HASH_MAX_NBYTES`` of an adapter's weights
(more is sampled), once per version of its files: fingerprints are cached
under the files' ``stat`` signature (device, inode, size, mtime, ctime), so
every later request costs a handful of ``stat`` calls. ctime is in it because
copies that preserve mtime (``cp -p``, ``rsync -a``) of a retrained adapter of
the same shapes keep size and mtime; no user tool can set ctime.

What the engine holds. vLLM's workers cache a loaded adapter by
``lora_int_id`` and do not look at its files again while it stays loaded. So
the first identity seen for an id is pinned for the life of this engine; if
the files under that id later hash differently, the workers may be running
either version, and the id shares no KV from then on (logged once). A fresh
engine, or the new files under a new id, fingerprints them anew. Left open:
a change landing between the first request's lookup here and the workers'
load of the adapter (milliseconds) is not seen until the next request;
deploy a changed adapter to a new directory, or restart, rather than rewrite
one a live engine serves.

Failing safe. An adapter whose files cannot be read (a hub name rather than
a local directory, a missing or unreadable file, a broken config) has no
identity: its requests are computed and their KV is neither loaded nor saved.
"""

from __future__ import annotations

import collections
import logging
import os
import stat

from .hashing import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHT_NAMES, adapter_fingerprint

# Under "vllm." so that vLLM's log handlers and format apply.
logger = logging.getLogger("vllm.ucm_connector.adapters")

Signature = tuple


def lora_settings(*, dtype: str, target_modules=None, fully_sharded: bool = False,
                  moe_mixed_format: bool = False, moe_shared: bool = False, tower: bool = False) -> str:
    """An engine's LoRA settings that change what an adapter computes, as the
    canonical string that enters every adapter's identity (``layout`` reads
    them from vLLM's config; ``ucm explain`` takes vLLM's defaults)."""
    import json

    settings = {
        "dtype": str(dtype).removeprefix("torch."),
        "target_modules": sorted(target_modules) if target_modules else None,
        "fully_sharded": bool(fully_sharded),
        "moe_mixed_format": bool(moe_mixed_format),
        "moe_shared": bool(moe_shared),
        "tower": bool(tower),
    }
    return json.dumps(settings, sort_keys=True, separators=(",", ":"))


def adapter_identity(fingerprint: str, engine_settings: str = "") -> str:
    """The string that stands for an adapter in block keys: the fingerprint
    of its files and the engine's LoRA settings."""
    return f"lora:{fingerprint}/{engine_settings}" if engine_settings else f"lora:{fingerprint}"


def adapter_signature(adapter_path: str) -> Signature:
    """What ``stat`` says of the files vLLM would read from ``adapter_path``:
    equal signatures mean the same files, unchanged (``OSError`` if the
    config or every weight file is missing)."""
    config = os.stat(os.path.join(adapter_path, ADAPTER_CONFIG_NAME))
    for name in ADAPTER_WEIGHT_NAMES:
        try:
            weights = os.stat(os.path.join(adapter_path, name))
        except FileNotFoundError:
            continue
        # vLLM passes over a name that is not a regular file (os.path.isfile)
        # and reads the next; so must the signature, or it would watch a file
        # that is never read.
        if stat.S_ISREG(weights.st_mode):
            return (_stat_key(config), name, _stat_key(weights))
    raise FileNotFoundError(f"no adapter weights ({', '.join(ADAPTER_WEIGHT_NAMES)}) in "
                            f"{adapter_path!r}")


def _stat_key(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class AdapterIdentities:
    """Per engine: the key identity of each adapter, or ``None`` where its
    KV must not be shared.

    ``engine_settings`` names the engine's LoRA settings that change an
    adapter's output (e.g. its LoRA dtype); it enters every identity.
    """

    MAX_FINGERPRINTS = 1024

    def __init__(self, engine_settings: str = "") -> None:
        self._engine_settings = engine_settings
        # signature -> fingerprint, for any path: bounded, as each rewrite of
        # an adapter's files adds a signature.
        self._fingerprints: collections.OrderedDict[Signature, str] = collections.OrderedDict()
        # adapter id -> (signature, fingerprint) first served by this engine.
        self._pinned: dict[int, tuple[Signature, str]] = {}
        self._unshared_ids: set[int] = set()
        self._logged: set[tuple[str, object]] = set()

    def identity(self, adapter_id: int, path: str, name: str = "") -> str | None:
        """The string that stands for this adapter in block keys; ``None``
        when its requests must neither load nor save KV."""
        if adapter_id in self._unshared_ids:
            return None
        local_path = os.path.abspath(os.path.expanduser(path))
        try:
            signature = adapter_signature(local_path)
            pinned = self._pinned.get(adapter_id)
            if pinned is not None and pinned[0] == signature:
                return self._format(pinned[1])
            fingerprint = self._fingerprint(local_path, signature)
        except (OSError, ValueError) as exc:
            self._log_once(
                ("unreadable", local_path),
                "ucm-connector: LoRA adapter %r at %r: cannot read its files (%s)"
                "; its requests run without the external cache"
                " (serve the adapter from a local directory to share its KV)",
                name, path, exc)
            return None
        if pinned is not None and pinned[1] != fingerprint:
            self._unshared_ids.add(adapter_id)
            self._pinned.pop(adapter_id, None)
            self._log_once(
                ("changed", adapter_id),
                "ucm-connector: LoRA adapter %r (id %d) at %r"
                " changed on disk while this engine serves it"
                "; its requests run without the external cache in this engine"
                " (deploy a changed adapter to a new directory or under a new id)",
                name, adapter_id, path)
            return None
        self._pinned[adapter_id] = (signature, fingerprint)
        return self._format(fingerprint)

    def _fingerprint(self, path: str, signature: Signature) -> str:
        fingerprint = self._fingerprints.get(signature)
        if fingerprint is not None:
            self._fingerprints.move_to_end(signature)
            return fingerprint
        fingerprint = adapter_fingerprint(path)
        # The files changed while being hashed: the fingerprint may mix two
        # versions, so it identifies neither.
        if adapter_signature(path) != signature:
            raise OSError(f"adapter files changed while being fingerprinted: {path}")
        self._fingerprints[signature] = fingerprint
        if len(self._fingerprints) > self.MAX_FINGERPRINTS:
            self._fingerprints.popitem(last=False)
        return fingerprint

    def _format(self, fingerprint: str) -> str:
        return adapter_identity(fingerprint, self._engine_settings)

    def _log_once(self, what: tuple[str, object], message: str, *args) -> None:
        if what not in self._logged:
            self._logged.add(what)
            logger.warning(message, *args)
