"""Stores of KV blocks as opaque bytes under content-address keys.

Knows nothing of vLLM or torch.  ``open_store(url)`` is the way in; see
``base.KVStore`` for the contract every backend keeps.
"""

from .base import KVStore, OpenMode, StoreError, StoreOpenError, StoreStats, StoreUnavailableError
from .registry import ENTRY_POINT_GROUP, known_schemes, open_store, register_scheme, which_store

__all__ = [
    "ENTRY_POINT_GROUP",
    "KVStore",
    "OpenMode",
    "StoreError",
    "StoreOpenError",
    "StoreStats",
    "StoreUnavailableError",
    "known_schemes",
    "open_store",
    "register_scheme",
    "which_store",
]
