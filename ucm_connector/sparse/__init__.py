"""Sparse-attention methods behind one small interface (``base.py``).

A method is chosen by ``"sparse": {"method": NAME, ...options}`` in
``kv_connector_extra_config``; ``registry.py`` finds it (built-in, registered
in-process, or under the entry-point group ``ucm_connector.sparse_methods``).
The calls into a method come from the monkey patches in ``patches/``; a
method knows attention math only, never vLLM's classes.
"""

from .base import (
    AttentionBatch,
    BlockSelection,
    RequestStart,
    SparseConfigError,
    SparseMethod,
    SparseStats,
    StepInfo,
)
from .registry import (
    ENTRY_POINT_GROUP,
    available_methods,
    build_method,
    method_class,
    register_method,
    unregister_method,
    validate,
)

__all__ = [
    "AttentionBatch", "BlockSelection", "RequestStart", "SparseConfigError", "SparseMethod",
    "SparseStats", "StepInfo", "ENTRY_POINT_GROUP", "available_methods", "build_method",
    "method_class", "register_method", "unregister_method", "validate",
]
