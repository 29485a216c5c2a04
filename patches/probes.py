"""Read-only probes of vLLM internals the connector needs, guarded like the
patches: each checks the vLLM release series and the shape of what it reads
before reading it, and says what differs instead of failing somewhere deep.
Nothing here changes vLLM.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from ._core import PatchError, vllm_version

_SERIES = ("0.32", "0.33")


def _private(module: str, name: str, params: tuple[str, ...]) -> Any:
    version = vllm_version()
    series = ".".join(version.split(".")[:2])
    if series not in _SERIES:
        raise PatchError(f"probe {module}.{name} supports vLLM {', '.join(s + '.x' for s in _SERIES)}; "
                         f"this is vLLM {version}")
    try:
        func = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise PatchError(f"probe {module}.{name} not found in vLLM {version} ({exc})") from None
    found = tuple(inspect.signature(func).parameters)
    if found[:len(params)] != params:
        raise PatchError(f"probe {module}.{name} has parameters ({', '.join(found)}) in vLLM {version}; "
                         f"expected ({', '.join(params)}, ...)")
    return func


def cpu_attention_isa(dtype, block_size: int, head_size: int, cache_dtype: str) -> str:
    """How vLLM's CPU attention packs K and V in a page (``vec``, ``vec16``,
    ``amx``, ...): pages are only meaningful to the same packing."""
    func = _private("vllm.v1.attention.backends.cpu_attn", "_get_attn_isa",
                    ("dtype", "block_size", "head_size", "kv_cache_dtype"))
    return str(func(dtype, block_size, head_size, cache_dtype))
