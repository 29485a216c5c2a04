"""UCMConfig: ``kv_connector_extra_config`` (and its ``config_file``) parsed
into a typed, validated configuration.

Owns the names, types, defaults and meanings of every connector option, in
one table (``OPTIONS``) that the docs are checked against.  An unknown key or
a bad value stops start-up with a message that names the key and says what
is expected.  Knows nothing of vLLM; the connector hands it the dict.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Any, Callable, Mapping

from store_backends.registry import url_scheme
from store_backends.base import StoreOpenError
from store_backends.urls import mask_password


class UCMConfigError(ValueError):
    """A connector option is unknown or has a bad value."""


class LoadMode(str, enum.Enum):
    """How hits are loaded: before the step (``sync``), on a loader thread
    while the request waits (``async``, ``load_kv_async``), or layer by
    layer during the forward pass (``layer``, ``load_layerwise``)."""

    SYNC = "sync"
    ASYNC = "async"
    LAYER = "layer"


def default_store_url() -> str:
    """``disk://`` under the user's cache directory: works with no server."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return f"disk://{os.path.join(os.path.abspath(base), 'ucm-connector', 'kv')}?capacity=20GiB"


@dataclasses.dataclass(frozen=True)
class Option:
    name: str
    kind: str                 # what a user writes, for messages and docs
    default: Any
    help: str
    check: Callable[[str, Any], Any]


def _store(name: str, value: Any) -> str | tuple[str, ...]:
    urls = [value] if isinstance(value, str) else value
    if not isinstance(urls, (list, tuple)) or not urls or not all(isinstance(u, str) for u in urls):
        raise UCMConfigError(f"{name}: expected a store URL or a non-empty list of store URLs, "
                             f"got {mask_password(repr(value))}")
    for url in urls:
        try:
            url_scheme(url)
        except StoreOpenError as exc:
            raise UCMConfigError(f"{name}: {exc}") from None
    return urls[0] if len(urls) == 1 else tuple(urls)


def _choice(*choices: str) -> Callable[[str, Any], str]:
    def check(name: str, value: Any) -> str:
        if value not in choices:
            raise UCMConfigError(f"{name}: expected one of {', '.join(choices)}, got {value!r}")
        return value
    return check


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UCMConfigError(f"{name}: expected a positive integer, got {value!r}")
    return value


def _at_most(limit: int, why: str) -> Callable[[str, Any], int]:
    def check(name: str, value: Any) -> int:
        value = _positive_int(name, value)
        if value > limit:
            raise UCMConfigError(f"{name}: {value} is more than {limit} ({why})")
        return value
    return check


# Pending saves are host memory, counted in bytes as ``mib << 20``: 1 TiB
# is more than any host gives a write-behind queue, and keeps that count
# far inside 64 bits.
MAX_PENDING_SAVE_MIB = 1 << 20


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise UCMConfigError(f"{name}: expected true or false, got {value!r}")
    return value


def _bool_or_auto(name: str, value: Any) -> bool | str:
    if value != "auto" and not isinstance(value, bool):
        raise UCMConfigError(f"{name}: expected auto, true or false, got {value!r}")
    return value


def _path(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise UCMConfigError(f"{name}: expected a file path, got {value!r}")
    return value


def _sparse(name: str, value: Any) -> dict | None:
    if value is None:
        return None
    from .sparse import SparseConfigError, validate

    try:
        return validate(value)
    except SparseConfigError as exc:
        raise UCMConfigError(f"{name}: {exc}") from None


OPTIONS: tuple[Option, ...] = (
    Option("store", "URL or list of URLs", None,
           "Where blocks are kept: a store URL, or a list of URLs = tiers, fastest first. "
           "Default: disk:// under the user's cache directory ($XDG_CACHE_HOME/ucm-connector/kv, "
           "or ~/.cache/ucm-connector/kv without XDG_CACHE_HOME; 20GiB).",
           _store),
    Option("config_file", "path", None,
           "A YAML file with the same keys; keys given in kv_connector_extra_config win.", _path),
    Option("sparse", "object", None,
           "Sparse attention at decode: {\"method\": NAME, ...options}, e.g. "
           "{\"method\": \"block_topk\", \"keep_ratio\": 0.25}; absent = dense attention. "
           "Part of the namespace: engines share blocks only with engines of the same option.", _sparse),
    Option("tier_write_mode", "async | sync", "async",
           "With tiers: write lower tiers in the background (async) or before a save completes (sync).",
           _choice("async", "sync")),
    Option("max_pending_save_mib", "int", 1024,
           "Bound on saved KV waiting for the background writer; beyond it saves are skipped and counted. "
           f"At most {MAX_PENDING_SAVE_MIB} (1 TiB).",
           _at_most(MAX_PENDING_SAVE_MIB, "1 TiB; the pending saves are held in host memory")),
    Option("min_hit_blocks", "int", 1,
           "Fewest stored leading blocks worth loading; shorter hits are computed instead.",
           _positive_int),
    Option("load_kv_async", "bool", False,
           "Load hits on a background thread: the request waits while other requests run, "
           "instead of the step waiting for the load. Always so under vLLM's async scheduling (its default "
           "on GPUs), where a step runs before a failed load of the step before is known.",
           _bool),
    Option("load_layerwise", "bool", False,
           "Load hits layer by layer while the forward pass runs: layer i's attention waits "
           "only for layer i's pages. Not together with load_kv_async, and not under async scheduling "
           "(loads are then asynchronous, with a warning). On CUDA it needs piecewise CUDA "
           "graphs (vLLM 0.32 and 0.33 switch to them by themselves); an engine that replays full ones "
           "loads before the step instead, with a warning.",
           _bool),
    Option("save_layerwise", "auto | true | false", "auto",
           "Gather each layer's new blocks for saving as soon as that layer's attention is done, so that "
           "the copies overlap the rest of the forward pass (on CUDA only in steps that save at least "
           "16 MiB); without it the blocks are gathered once the forward pass is done. auto: on CUDA, "
           "where it frees the next step's kernels sooner, not on CPU, where it is slower. Off in an "
           "engine that runs microbatches (--enable-dbo), with a warning where it was asked for.",
           _bool_or_auto),
    Option("load_policy", "always | auto", "auto",
           "Which stored hits to load: every one (always), or (auto) only as much of each as loads "
           "faster than the engine recomputes it, judged from the store's read speed and latency "
           "(per tier) and the engine's prefill speed as the workers measure them; until there "
           "is a measurement, auto loads like always. Hit tokens left unloaded are counted in "
           "vllm:ucm_unloaded_hit_tokens_total by reason.",
           _choice("always", "auto")),
    Option("on_cache_reset", "new_keys | keep", "new_keys",
           "What vLLM's reset of the connector's cache does (reset_prefix_cache(reset_connector=True), "
           "pause_generation, sleep at level 1 or 2: what a weight update goes through). new_keys: from "
           "then on this engine loads and saves under keys of its own, so KV made by the weights before "
           "is never loaded, and KV of the new weights never stored where other engines look. keep: go on "
           "loading what is stored; only for engines whose weights never change in place (sleep mode "
           "used to share a GPU).",
           _choice("new_keys", "keep")),
)
_BY_NAME = {o.name: o for o in OPTIONS}


def _default(name: str):
    """An option's default, from ``OPTIONS``: the one place defaults live."""
    return _BY_NAME[name].default


@dataclasses.dataclass(frozen=True)
class UCMConfig:
    """The validated options (``from_extra_config``); field defaults come
    from ``OPTIONS``, and a test keeps the fields and the table in step."""

    store: str | tuple[str, ...]
    config_file: str | None = _default("config_file")
    sparse: dict | None = _default("sparse")
    tier_write_mode: str = _default("tier_write_mode")
    max_pending_save_mib: int = _default("max_pending_save_mib")
    min_hit_blocks: int = _default("min_hit_blocks")
    load_kv_async: bool = _default("load_kv_async")
    load_layerwise: bool = _default("load_layerwise")
    save_layerwise: bool | str = _default("save_layerwise")
    load_policy: str = _default("load_policy")
    on_cache_reset: str = _default("on_cache_reset")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "UCMConfig":
        """Validate ``kv_connector_extra_config`` (merged over its
        ``config_file``, if any) into a config."""
        extra = dict(extra or {})
        _reject_unknown(extra, "kv_connector_extra_config")
        merged: dict[str, Any] = {}
        config_file = _path("config_file", extra.get("config_file"))
        if config_file:
            from_file = _load_yaml(config_file)
            _reject_unknown(from_file, f"config_file {config_file!r}")
            if "config_file" in from_file:
                raise UCMConfigError(f"config_file {config_file!r}: 'config_file' cannot be nested")
            merged.update(from_file)
        merged.update(extra)
        values = {}
        for option in OPTIONS:
            if option.name in merged:
                values[option.name] = option.check(option.name, merged[option.name])
            elif option.default is not None:
                values[option.name] = option.default
        values.setdefault("store", default_store_url())
        if values.get("load_kv_async") and values.get("load_layerwise"):
            raise UCMConfigError("load_kv_async and load_layerwise: choose one way of loading, not both")
        return cls(**values)

    @property
    def load_mode(self) -> LoadMode:
        if self.load_kv_async:
            return LoadMode.ASYNC
        return LoadMode.LAYER if self.load_layerwise else LoadMode.SYNC

    @property
    def store_urls(self) -> list[str]:
        return [self.store] if isinstance(self.store, str) else list(self.store)


def _reject_unknown(mapping: Mapping[str, Any], where: str) -> None:
    for key in mapping:
        if key not in _BY_NAME:
            import difflib

            near = difflib.get_close_matches(str(key), list(_BY_NAME), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise UCMConfigError(
                f"{where}: unknown key {key!r}{hint}; known keys: {', '.join(sorted(_BY_NAME))}")


def _load_yaml(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise UCMConfigError(f"config_file {path!r}: cannot be read: {exc.strerror}") from None
    # Editors on Windows start UTF-8 files with a byte order mark.
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise UCMConfigError(
            f"config_file {path!r}: not UTF-8 text (byte 0x{raw[exc.start]:02x} on line {line}); "
            f"save it as UTF-8") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # YAML quotes the offending line, which may hold a store URL.
        raise UCMConfigError(f"config_file {path!r}: not valid YAML: {mask_password(exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UCMConfigError(f"config_file {path!r}: expected a mapping of keys to values, got {type(data).__name__}")
    return data
