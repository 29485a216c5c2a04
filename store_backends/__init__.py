"""Stores of KV blocks as opaque bytes under content-address keys.

Knows nothing of vLLM or torch.  ``open_store(url)`` is the way in; see
``base.KVStore`` for the contract every backend keeps.  The admin API of
``shm://`` servers (``list_servers``, ``server_status``...; see
``store_backends.shm``) is re-exported here for operators, and imported on
first use: opening a disk or Redis store never loads the shm code.  What
operators' tools share is exported too: ``url_scheme`` and
``mask_password`` for the URLs they are given, and ``Progress``, the
one-line progress report of ``ucm`` and ``ucm-bench``.
"""

from .base import KVStore, OpenMode, StoreError, StoreOpenError, StoreStats, StoreUnavailableError
from .pausing import PausingStore, pause_unavailable
from .progress import Progress
from .registry import (ENTRY_POINT_GROUP, check_scheme, known_schemes, open_store, register_scheme, url_scheme,
                       which_store)
from .urls import mask_password

_SHM_ADMIN = frozenset({"ServerStatus", "ShmServerNotRunning", "UnsafeRuntimeDir", "check_runtime_dir",
                        "list_servers", "server_running", "server_status", "stop_server", "valid_name"})


def __getattr__(name: str) -> object:
    if name in _SHM_ADMIN:
        from . import shm

        return getattr(shm, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ENTRY_POINT_GROUP",
    "KVStore",
    "OpenMode",
    "PausingStore",
    "Progress",
    "ServerStatus",
    "ShmServerNotRunning",
    "StoreError",
    "StoreOpenError",
    "StoreStats",
    "StoreUnavailableError",
    "UnsafeRuntimeDir",
    "check_runtime_dir",
    "check_scheme",
    "known_schemes",
    "list_servers",
    "mask_password",
    "open_store",
    "pause_unavailable",
    "register_scheme",
    "server_running",
    "server_status",
    "stop_server",
    "url_scheme",
    "valid_name",
    "which_store",
]
