"""Portable content addresses: the namespace of an engine and the key of each block.

This module owns what a block key covers and how it is encoded. It knows
nothing of vLLM or torch (the connector turns vLLM's config and requests into
the plain values taken here) and nothing of the stores (a key is ``bytes``).

A key must be the same for the same KV in any process on any host, so nothing
here depends on Python's ``hash``, ``PYTHONHASHSEED``, pickle, dict order or a
file path. Every structure is written in a canonical byte encoding where each
variable-length field carries a type tag and a length prefix, so two different
inputs cannot produce the same bytes by concatenation; the hash is xxh3-128.

Namespace
    ``Namespace.digest`` (16 bytes) covers everything that decides what the
    KV bytes of a block look like: the model weights' fingerprint (not their
    path), dtype, KV layout (backend and packing), block size, layers, kv
    heads, head size, TP rank and size, and the block format version.

Keys
    The chain starts at a per-request root::

        root     = xxh3_128("ucm-root" || tp_group_digest || lora || cache_salt)
        digest_i = xxh3_128(digest_{i-1} || tokens of block i as u32 LE || mm_i)
                   with digest_{-1} = root
        key_i    = digest_i || tp_rank as u16 LE                   (18 bytes)

    ``lora`` is the adapter's identity, a fingerprint of its files
    (``adapter_fingerprint``, via ``adapters.AdapterIdentities``), never its
    name or path: one name can mean two adapters, and one adapter can live
    under two paths.

    ``tp_group_digest`` is the namespace digest without the TP rank, and the
    rank is the key's last two bytes instead. All ranks of one deployment
    thereby share one chain: the scheduler hashes a prompt once and derives
    every rank's keys by swapping the suffix (``keys_for_rank``), yet no two
    ranks, and no two namespaces, share a key. LoRA and cache_salt hold for
    the whole request, so they enter the root, which changes every key through
    the chain exactly as mixing them into block 0 would, at no per-block cost.
    Multimodal spans enter only the blocks they overlap (``mm_i`` is empty for
    the others; the parent and the tokens have a fixed length given the
    namespace, so an empty ``mm_i`` cannot be confused with a present one).

    A namespace prefix in the key would add 16 bytes to every key for nothing:
    the root already separates namespaces, and a block's header (blockfmt)
    carries the full namespace digest, which is checked on every load.
"""

from __future__ import annotations

import array
import json
import os
import struct
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from typing import NewType

import numpy as np
import xxhash

from ucm_connector.blockfmt import DIGEST_NBYTES, FORMAT_VERSION

#: A block's content address as stored: its 16-byte chain digest and the TP
#: rank (``KEY_NBYTES``).  vLLM's ``kv_cache_utils`` types its BlockHash the
#: same way: bytes, but not any bytes.
BlockKey = NewType("BlockKey", bytes)
#: 16 bytes naming a namespace (model, geometry, rank, format).
NamespaceDigest = NewType("NamespaceDigest", bytes)

KEY_NBYTES = DIGEST_NBYTES + 2
# Bumped whenever the encoding of namespaces or keys changes, so that a
# changed scheme can never read keys made by an older one.
KEY_SCHEME_VERSION = 1

# Looked up at each call (not bound at import) so tests can count calls.
_xxh3_128 = xxhash.xxh3_128_digest

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")


def _enc_str(value: str) -> bytes:
    data = value.encode("utf-8")
    return b"s" + _U32.pack(len(data)) + data


def _enc_int(value: int) -> bytes:
    return b"i" + _I64.pack(value)


def _enc_opt_str(value: str | None) -> bytes:
    return b"n" if value is None else _enc_str(value)


# -- model fingerprint -------------------------------------------------------

FULL_HASH_MAX_NBYTES = 64 << 20
"""Weight files up to this size are hashed whole; larger ones are sampled."""

_EDGE_NBYTES = 1 << 20
_NUM_INNER_SAMPLES = 16
_INNER_SAMPLE_NBYTES = 64 << 10
_READ_CHUNK_NBYTES = 4 << 20
_SAFETENSORS_MAX_HEADER_NBYTES = 100 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".tensors")
# config.json keys that name where or with what a model was saved, not what it is.
_CONFIG_KEYS_IGNORED = ("transformers_version",)


HUGGINGFACE = "huggingface"
MODELSCOPE = "modelscope"
"""The hubs a model name may come from (vLLM takes names from ModelScope
where ``VLLM_USE_MODELSCOPE`` is set)."""


def model_hub() -> str:
    """The hub vLLM takes model names from: ModelScope where
    ``VLLM_USE_MODELSCOPE`` is 1 or true (read as vLLM reads it), else
    Hugging Face."""
    use = os.environ.get("VLLM_USE_MODELSCOPE", "False").strip().lower() in ("1", "true")
    return MODELSCOPE if use else HUGGINGFACE


def name_fingerprint(model: str, revision: str | None = None, hub: str = HUGGINGFACE) -> str:
    """The fingerprint of a hub model name with no local files: for the
    Hugging Face hub, the name and the commit its files in the Hugging Face
    cache came from (the revision asked for, or ``main``, resolved there),
    so that a model republished under its name, or another snapshot on
    another host, is another model; the revision asked for where nothing is
    cached.  Another hub's names are kept apart from Hugging Face's: one
    name may be two models there."""
    if hub == HUGGINGFACE:
        commit = _cached_commit(model, revision)
        if commit is not None:
            revision = commit
    name = model if revision is None else f"{model}@{revision}"
    if hub != HUGGINGFACE:
        name = f"{hub}:{name}"
    return "name:" + xxhash.xxh3_128_hexdigest(name.encode())


def modelscope_snapshot(model: str, revision: str | None = None) -> str | None:
    """The directory of ModelScope's local copy of ``model`` in ModelScope's
    own cache (where vLLM's loader downloads a ModelScope model's weights,
    whatever its ``--download-dir``), asked of ModelScope without going to
    the network; None where nothing is cached or ModelScope is not
    installed.  Such a snapshot is named by the revision asked for
    (``master``), not by a commit, and a later download of a republished
    model replaces its files: so the model is known by its weight files, as
    a local directory is."""
    try:
        from modelscope.hub.snapshot_download import snapshot_download

        path = snapshot_download(model_id=model, revision=revision, local_files_only=True)
    except Exception:       # nothing cached, or no modelscope
        return None
    path = os.fspath(path) if path else None
    return path if path and os.path.isdir(path) else None


def _cached_commit(model: str, revision: str | None) -> str | None:
    """The commit of the Hugging Face cache's snapshot of ``model`` at
    ``revision`` (vLLM fetches ``config.json`` before it builds an engine)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(model, "config.json", revision=revision)
    except Exception:       # no huggingface_hub, or not a repository name
        return None
    return os.path.basename(os.path.dirname(path)) if isinstance(path, str) else None


def model_fingerprint(model_path: str | os.PathLike) -> str:
    """A 32-hex-digit fingerprint of a model's weights and config, the same
    for a copy in another directory and different when the weights differ.

    ``model_path`` is a model directory or a single weights file (GGUF).
    The fingerprint covers, for each weight file in name order: its name
    relative to the directory, its size, and its bytes. Files of up to
    ``FULL_HASH_MAX_NBYTES`` are hashed whole (tens of GB/s). Larger files are
    sampled, so that fingerprinting a multi-GB model costs a few MiB of reads:
    for safetensors the whole JSON header (every tensor's name, dtype, shape
    and offsets), and for any large file its first and last MiB and 16 evenly
    spaced 64 KiB pieces. Fine-tunes change nearly every tensor, so they are
    told apart; an edit confined to unsampled bytes of a large file is not,
    which is the price of a start-up measured in milliseconds.

    ``config.json`` is included (it decides RoPE, attention and so the KV),
    parsed and re-encoded with sorted keys, without keys that record the
    save path or tool version (``_name_or_path`` and the like); so is
    ``params.json``, Mistral's format of the same, where there is one.
    """
    path = os.fspath(model_path)
    if os.path.isfile(path):
        root, weight_files, config_path = os.path.dirname(path), [path], None
    elif os.path.isdir(path):
        root = path
        names = sorted(os.listdir(path))
        safetensors = [n for n in names if n.endswith(".safetensors")]
        # vLLM loads safetensors when a directory has them, ignoring .bin copies.
        chosen = safetensors or [n for n in names if n.endswith(_WEIGHT_SUFFIXES)]
        weight_files = [os.path.join(path, n) for n in chosen
                        if os.path.isfile(os.path.join(path, n))]
        config_path = os.path.join(path, "config.json")
    else:
        raise FileNotFoundError(f"model path {path!r} is neither a directory nor a file")
    if not weight_files:
        raise NoWeightFiles(
            f"no weight files ({', '.join(_WEIGHT_SUFFIXES)}) in {path!r}: cannot fingerprint the model's weights")

    hasher = xxhash.xxh3_128()
    hasher.update(b"ucm-model-fingerprint" + _enc_int(KEY_SCHEME_VERSION))
    if config_path is not None and os.path.isfile(config_path):
        hasher.update(b"config" + _enc_str(_canonical_config(config_path)))
    else:
        hasher.update(b"no-config")
    # Mistral's own format: vLLM may read the model's settings from here.
    params_path = os.path.join(root, "params.json") if config_path is not None else None
    if params_path is not None and os.path.isfile(params_path):
        hasher.update(b"params" + _enc_str(_canonical_config(params_path)))
    for file_path in weight_files:
        hasher.update(_enc_str(os.path.relpath(file_path, root).replace(os.sep, "/")))
        _hash_weight_file(hasher, file_path)
    return hasher.hexdigest()


class NoWeightFiles(ValueError):
    """A model directory without weight files."""


def config_fingerprint(model_dir: str | os.PathLike, origin: str = "") -> str:
    """The fingerprint (``config:`` and 32 hex digits) of a model whose
    weights are not in its directory, by what the directory says of them:
    ``config.json``, ``params.json`` and the weight index files (``*.index.json``: every
    tensor's name and file, the total size), canonicalised as for
    ``model_fingerprint``, and ``origin``, where the weights come from (an
    object store's URL, for weights vLLM streams from there; "" for none,
    as for ``--load-format dummy``).  Other weights published under the same
    URL with the same config and index are not told apart."""
    path = os.fspath(model_dir)
    hasher = xxhash.xxh3_128()
    hasher.update(b"ucm-config-fingerprint" + _enc_int(KEY_SCHEME_VERSION) + _enc_str(origin))
    for name in sorted(os.listdir(path)):
        if name in ("config.json", "params.json") or name.endswith(".index.json"):
            hasher.update(_enc_str(name) + _enc_str(_canonical_config(os.path.join(path, name))))
    return "config:" + hasher.hexdigest()


def model_identity(model: str, revision: str | None = None, weights: str | None = None,
                   hub: str = HUGGINGFACE) -> str:
    """The model fingerprint of a namespace, for vLLM's ``model``,
    ``revision`` and ``model_weights`` (set, to an object store's URL, where
    vLLM streams the weights from there and ``model`` is a local directory
    of the config files it pulled): a local model by its files
    (``model_fingerprint``; a directory without weights, by its config), a
    streamed one by its URL and config, a ModelScope name by the weight
    files of its local copy (``modelscope_snapshot``; by name where the
    copy holds none, as a tokenizer's download does), another hub name by
    ``name_fingerprint``."""
    if weights and weights != model and not os.path.exists(weights):
        if os.path.isdir(model):
            return config_fingerprint(model, origin=weights)
        return name_fingerprint(weights, revision)
    if os.path.exists(model):
        try:
            return model_fingerprint(model)
        except NoWeightFiles:
            if not os.path.isdir(model):
                raise
            return config_fingerprint(model)
    if hub == MODELSCOPE:
        snapshot = modelscope_snapshot(model, revision)
        if snapshot is not None:
            try:
                return model_fingerprint(snapshot)
            except NoWeightFiles:
                pass        # config or tokenizer files alone: two models may share those
    return name_fingerprint(model, revision, hub)


def _canonical_config(config_path: str) -> str:
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    if isinstance(config, dict):
        config = {k: v for k, v in config.items()
                  if not k.startswith("_") and k not in _CONFIG_KEYS_IGNORED}
    return json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _hash_weight_file(hasher, file_path: str) -> None:
    with open(file_path, "rb") as f:
        fd = f.fileno()
        nbytes = os.fstat(fd).st_size
        hasher.update(_enc_int(nbytes))
        if nbytes <= FULL_HASH_MAX_NBYTES:
            hasher.update(b"whole")
            for offset in range(0, nbytes, _READ_CHUNK_NBYTES):
                hasher.update(os.pread(fd, _READ_CHUNK_NBYTES, offset))
            return
        data_start = 0
        if file_path.endswith(".safetensors"):
            (header_nbytes,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            if 0 < header_nbytes <= min(_SAFETENSORS_MAX_HEADER_NBYTES, nbytes - 8):
                hasher.update(b"safetensors-header" + _enc_int(header_nbytes))
                hasher.update(os.pread(fd, header_nbytes, 8))
                data_start = 8 + header_nbytes
        hasher.update(b"sampled")
        for offset, length in _sample_ranges(data_start, nbytes):
            hasher.update(_enc_int(offset) + _enc_int(length))
            hasher.update(os.pread(fd, length, offset))


def _sample_ranges(start: int, end: int) -> list[tuple[int, int]]:
    span = end - start
    ranges = [(start, min(_EDGE_NBYTES, span))]
    inner = span - 2 * _EDGE_NBYTES
    if inner > 0:
        stride = inner // (_NUM_INNER_SAMPLES + 1)
        for i in range(1, _NUM_INNER_SAMPLES + 1):
            offset = start + _EDGE_NBYTES + i * stride
            ranges.append((offset, min(_INNER_SAMPLE_NBYTES, end - offset)))
    if span > _EDGE_NBYTES:
        tail = max(start + _EDGE_NBYTES, end - _EDGE_NBYTES)
        ranges.append((tail, end - tail))
    return ranges


# -- LoRA adapter fingerprint ------------------------------------------------

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHT_NAMES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")
"""The weight files of a PEFT adapter directory, in the order vLLM prefers
them (``LoRAModel.from_local_checkpoint`` reads the first that exists)."""

# adapter_config.json keys that record where the adapter came from or how it
# was trained, not what it computes: the base model it was trained on (the
# served base model is the namespace's fingerprint), the PEFT version that
# saved it, dropout (active in training only) and PEFT's frozen-for-inference
# flag. Every other key counts, known or not: r, lora_alpha, use_rslora,
# rank_pattern and alpha_pattern set each module's scaling; target_modules,
# modules_to_save and layers_to_transform say which modules are adapted;
# use_dora, bias and the like are refused by vLLM today and would change the
# output the day they are not. Counting a key that turns out not to matter
# costs a missed share between two copies that differ in it; ignoring one
# that matters would hand one adapter's KV to another. So this list only
# holds keys known to be inert.
_ADAPTER_CONFIG_KEYS_IGNORED = frozenset({
    "base_model_name_or_path", "revision", "peft_version", "transformers_version",
    "lora_dropout", "inference_mode",
})


def adapter_files(adapter_path: str | os.PathLike) -> tuple[str, str]:
    """The config and the weight file vLLM reads from an adapter directory.

    Raises ``FileNotFoundError`` when either is missing (vLLM would refuse
    the adapter too, or fetch it from a hub, which is not a local file to
    fingerprint)."""
    path = os.fspath(adapter_path)
    config_path = os.path.join(path, ADAPTER_CONFIG_NAME)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"no {ADAPTER_CONFIG_NAME} in adapter directory {path!r}")
    for name in ADAPTER_WEIGHT_NAMES:
        weights_path = os.path.join(path, name)
        if os.path.isfile(weights_path):
            return config_path, weights_path
    raise FileNotFoundError(
        f"no adapter weights ({', '.join(ADAPTER_WEIGHT_NAMES)}) in {path!r}")


def adapter_fingerprint(adapter_path: str | os.PathLike) -> str:
    """A 32-hex-digit fingerprint of a LoRA adapter: the same for a copy in
    another directory or under another name, different when its weights or
    any output-changing config differ.

    It covers the config (parsed and re-encoded with sorted keys, without the
    keys in ``_ADAPTER_CONFIG_KEYS_IGNORED`` and those starting with ``_``)
    and the one weight file vLLM loads, by its name (its format) and bytes,
    hashed like a model's weight file: whole up to ``FULL_HASH_MAX_NBYTES``,
    sampled beyond. The adapter's path and name never enter.
    """
    config_path, weights_path = adapter_files(adapter_path)
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"{config_path!r} is not a JSON object")
    config = {k: v for k, v in config.items()
              if not k.startswith("_") and k not in _ADAPTER_CONFIG_KEYS_IGNORED}
    hasher = xxhash.xxh3_128()
    hasher.update(b"ucm-adapter-fingerprint" + _enc_int(KEY_SCHEME_VERSION))
    hasher.update(b"config" + _enc_str(
        json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=True)))
    hasher.update(_enc_str(os.path.basename(weights_path)))
    _hash_weight_file(hasher, weights_path)
    return hasher.hexdigest()


# -- namespace ---------------------------------------------------------------

def _normalize_dtype(dtype: str) -> str:
    # "torch.bfloat16" (str of a torch dtype) and "bfloat16" name the same KV.
    dtype = str(dtype)
    return dtype[len("torch."):] if dtype.startswith("torch.") else dtype


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for a stored block's bytes to be usable.

    ``kv_layout`` names the physical layout of one block's bytes, e.g.
    ``"CPU_ATTN/vec"`` or ``"FLASH_ATTN"``: backend plus ISA packing, since a
    CPU page packed for AMX is not a page packed for AVX-512. ``extra`` holds
    further (name, value) pairs for inputs not foreseen here (pipeline stage,
    KV quantization scheme); their order does not matter.
    """

    model_fingerprint: str
    dtype: str
    kv_layout: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    tp_rank: int = 0
    tp_size: int = 1
    format_version: int = FORMAT_VERSION
    extra: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _normalize_dtype(self.dtype))
        extra = self.extra.items() if isinstance(self.extra, dict) else self.extra
        object.__setattr__(self, "extra", tuple(sorted((str(k), str(v)) for k, v in extra)))
        for name in ("model_fingerprint", "dtype", "kv_layout"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"Namespace.{name} must be a non-empty string, got {value!r}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_size", "tp_size",
                     "format_version"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Namespace.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(
                f"Namespace.tp_rank must be in [0, {self.tp_size}), got {self.tp_rank!r}")
        if self.tp_size > 0xFFFF:
            raise ValueError(f"Namespace.tp_size must fit in 16 bits, got {self.tp_size}")
        names = [k for k, _ in self.extra]
        if len(set(names)) != len(names):
            raise ValueError(f"Namespace.extra has a repeated name: {names}")

    def _encode(self, with_rank: bool) -> bytes:
        parts = [b"ucm-namespace", _enc_int(KEY_SCHEME_VERSION)]
        for f in fields(self):
            if f.name == "tp_rank" and not with_rank:
                continue
            value = getattr(self, f.name)
            parts.append(_enc_str(f.name))
            if f.name == "extra":
                parts.append(_enc_int(len(value)))
                for k, v in value:
                    parts.append(_enc_str(k) + _enc_str(v))
            elif isinstance(value, int):
                parts.append(_enc_int(value))
            else:
                parts.append(_enc_str(value))
        return b"".join(parts)

    @cached_property
    def digest(self) -> NamespaceDigest:
        """16 bytes identifying this namespace, stored in every block header."""
        return NamespaceDigest(_xxh3_128(self._encode(with_rank=True)))

    @cached_property
    def tp_group_digest(self) -> bytes:
        """The digest of this namespace without the TP rank: shared by all
        ranks of one deployment, it roots their common key chain."""
        return _xxh3_128(self._encode(with_rank=False))

    def for_rank(self, tp_rank: int) -> "Namespace":
        """This namespace as seen by another TP rank of the same deployment."""
        return Namespace(**{f.name: getattr(self, f.name) for f in fields(self)
                            if f.name != "tp_rank"}, tp_rank=tp_rank)

    def describe(self) -> str:
        """One line for logs and ``ucm`` output."""
        extra = "".join(f", {k}={v}" for k, v in self.extra)
        return (f"model {self.model_fingerprint[:12]} {self.dtype} {self.kv_layout}, "
                f"block {self.block_size}, {self.num_layers} layers x {self.num_kv_heads} "
                f"kv heads x {self.head_size}, tp {self.tp_rank}/{self.tp_size}, "
                f"format v{self.format_version}{extra} [ns {self.digest.hex()[:16]}]")


# -- block keys --------------------------------------------------------------

@dataclass(frozen=True)
class MultiModalSpan:
    """A multimodal input occupying tokens ``[offset, offset + length)`` of the
    prompt, identified by a content hash (vLLM's ``mm_hash``/identifier)."""

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise ValueError(f"bad multimodal span {self!r}: need offset >= 0 and length > 0")


@dataclass(frozen=True)
class KeyExtras:
    """What besides its tokens enters a request's keys: the LoRA adapter's
    identity and the ``cache_salt`` (in the chain's root), and multimodal
    inputs (in the blocks they cover)."""

    lora: str | None = None
    cache_salt: str | None = None
    mm_spans: tuple[MultiModalSpan, ...] = ()


_U32_TYPECODE = next(c for c in "IL" if array.array(c).itemsize == 4)
_NEEDS_BYTESWAP = sys.byteorder != "little"


def tokens_to_bytes(token_ids) -> memoryview:
    """Token ids as contiguous little-endian uint32 bytes (one conversion for
    the whole list, so the hashing loop only slices)."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() > 0xFFFFFFFF):
            raise ValueError("token ids must be in [0, 2**32)")
        return memoryview(np.ascontiguousarray(token_ids, dtype="<u4")).cast("B")
    if not isinstance(token_ids, (list, tuple)):
        # vLLM's ConstantList and similar wrappers iterate slowly; a slice
        # hands back the underlying list in one C-level copy.
        token_ids = token_ids[:]
    try:
        arr = array.array(_U32_TYPECODE, token_ids)
    except OverflowError as exc:
        raise ValueError(f"token ids must be in [0, 2**32): {exc}") from None
    if _NEEDS_BYTESWAP:
        arr.byteswap()
    return memoryview(arr).cast("B")


def keys_for_rank(keys: Iterable[bytes], tp_rank: int) -> list[BlockKey]:
    """The same blocks' keys for another TP rank (a suffix swap, no hashing)."""
    suffix = _U16.pack(tp_rank)
    return [BlockKey(key[:DIGEST_NBYTES] + suffix) for key in keys]


def key_digest(key: bytes) -> bytes:
    """The chain digest inside a key (its rank-independent part)."""
    return key[:DIGEST_NBYTES]


class BlockHasher:
    """Hashes the full blocks of token lists into keys of one namespace.

    One per engine (scheduler and each worker); cheap to share, holds no
    per-request state. Hashing a list converts it to bytes once, then runs one
    xxh3_128 call per block on ``parent || slice``: measured faster here than
    a streaming hasher per block (``benchmarks/hash_bench.py``).
    """

    def __init__(self, namespace: Namespace, generation: bytes = b""):
        if generation and len(generation) != DIGEST_NBYTES:
            raise ValueError(f"a key generation is {DIGEST_NBYTES} bytes, got {len(generation)}")
        self.namespace = namespace
        self.generation = bytes(generation)
        self.block_size = namespace.block_size
        self._block_nbytes = 4 * namespace.block_size
        self._suffix = _U16.pack(namespace.tp_rank)
        # A later generation's roots start with another tag of the same
        # length, so no root of one generation is hashed from the bytes of
        # another's.
        self._root_prefix = (b"ucm-regn" + self.generation if generation else b"ucm-root") \
            + namespace.tp_group_digest

    def next_generation(self) -> "BlockHasher":
        """A hasher of the same namespace whose keys share no block with this
        one's or any other generation's (a random generation): what the
        engine uses once its weights may have changed."""
        return BlockHasher(self.namespace, os.urandom(DIGEST_NBYTES))

    def root(self, *, lora: str | None = None, cache_salt: str | None = None) -> bytes:
        """The chain's starting digest for a request with these extras."""
        return _xxh3_128(self._root_prefix + _enc_opt_str(lora) + _enc_opt_str(cache_salt))

    def block_keys(self, token_ids, *, lora: str | None = None, cache_salt: str | None = None,
                   mm_spans: Sequence[MultiModalSpan] = ()) -> list[BlockKey]:
        """Keys of all full blocks of ``token_ids``; a partial last block has none."""
        # chain() skips the partial tail; converting it costs less than slicing.
        return self.chain(tokens_to_bytes(token_ids), self.root(lora=lora, cache_salt=cache_salt),
                          0, _spans_by_block(mm_spans, self.block_size))

    def chain(self, data: memoryview, parent: bytes, first_block: int,
              mm_extras: dict[int, bytes] | None = None) -> list[BlockKey]:
        """Keys of the blocks in ``data`` (whole blocks of u32 LE tokens) that
        follow the block whose digest is ``parent``; ``first_block`` is the
        index of the first of them in the request, used to place mm extras."""
        step = self._block_nbytes
        nbytes = len(data) - len(data) % step
        suffix = self._suffix
        h = _xxh3_128
        keys: list[BlockKey] = []
        append = keys.append
        if not mm_extras:
            for offset in range(0, nbytes, step):
                parent = h(parent + data[offset:offset + step])
                append(parent + suffix)
            return keys
        get_extra = mm_extras.get
        block = first_block
        for offset in range(0, nbytes, step):
            extra = get_extra(block)
            if extra is None:
                parent = h(parent + data[offset:offset + step])
            else:
                parent = h(parent + data[offset:offset + step] + extra)
            append(parent + suffix)
            block += 1
        return keys

    def request(self, *, lora: str | None = None, cache_salt: str | None = None,
                mm_spans: Sequence[MultiModalSpan] = ()) -> "RequestKeys":
        """A per-request key cache; see ``RequestKeys``."""
        return RequestKeys(self, lora=lora, cache_salt=cache_salt, mm_spans=mm_spans)

    def request_for(self, extras: KeyExtras) -> "RequestKeys":
        """``request`` for a request's ``KeyExtras``."""
        return RequestKeys(self, lora=extras.lora, cache_salt=extras.cache_salt, mm_spans=extras.mm_spans)


def _spans_by_block(mm_spans: Sequence[MultiModalSpan], block_size: int) -> dict[int, bytes]:
    """The encoded multimodal extra of each block that a span overlaps. Each
    entry records the span's hash and its place relative to the block, so
    the same image at another position in the block gives another key."""
    per_block: dict[int, list[MultiModalSpan]] = {}
    for span in mm_spans:
        if not isinstance(span, MultiModalSpan):
            span = MultiModalSpan(*span)
        first = span.offset // block_size
        last = (span.offset + span.length - 1) // block_size
        for block in range(first, last + 1):
            per_block.setdefault(block, []).append(span)
    encoded = {}
    for block, spans in per_block.items():
        start = block * block_size
        spans.sort(key=lambda s: (s.offset, s.length, s.identifier))
        parts = [b"mm", _enc_int(len(spans))]
        for span in spans:
            parts.append(_enc_int(span.offset - start) + _enc_int(span.length)
                         + _enc_str(span.identifier))
        encoded[block] = b"".join(parts)
    return encoded


class RequestKeys:
    """The keys of one request, extended as its tokens grow.

    ``update`` may be called any number of times with the request's growing
    token list (the scheduler asks on every lookup, and decode appends
    tokens); each block is hashed once, on the first call that sees it full.
    The token list must only grow: the tokens of the last hashed block are
    compared on every call, which catches a caller passing another request's
    tokens, and a mismatch raises rather than return keys of other content.
    """

    def __init__(self, hasher: BlockHasher, *, lora: str | None = None,
                 cache_salt: str | None = None, mm_spans: Sequence[MultiModalSpan] = ()):
        self._hasher = hasher
        self._block_size = hasher.block_size
        self._parent = hasher.root(lora=lora, cache_salt=cache_salt)
        self._mm_extras = _spans_by_block(mm_spans, hasher.block_size)
        self._keys: list[BlockKey] = []
        self._last_block_tokens: list[int] = []

    @property
    def num_blocks(self) -> int:
        """Full blocks hashed so far."""
        return len(self._keys)

    @property
    def num_tokens(self) -> int:
        """Tokens covered by the keys so far."""
        return len(self._keys) * self._block_size

    @property
    def keys(self) -> list[BlockKey]:
        return list(self._keys)

    def update(self, token_ids: Sequence[int]) -> list[BlockKey]:
        """Keys of all full blocks of ``token_ids``, hashing only new blocks."""
        bs = self._block_size
        done = len(self._keys) * bs
        if done:
            last = token_ids[done - bs:done]
            if len(last) != bs or list(last) != self._last_block_tokens:
                raise ValueError(
                    "token_ids do not extend the tokens already hashed for this request "
                    f"(block {len(self._keys) - 1} differs)")
        num_blocks = len(token_ids) // bs
        if num_blocks > len(self._keys):
            # A fresh request converts the list as it is (chain() skips the
            # partial tail) rather than paying for a sliced copy.
            new_tokens = token_ids[done:] if done else token_ids
            new_keys = self._hasher.chain(tokens_to_bytes(new_tokens), self._parent,
                                          len(self._keys), self._mm_extras)
            self._keys.extend(new_keys)
            self._parent = new_keys[-1][:DIGEST_NBYTES]
            self._last_block_tokens = list(token_ids[(num_blocks - 1) * bs:num_blocks * bs])
        return list(self._keys[:num_blocks])
