"""Sparse-attention methods by name: the built-in ones, those registered in
this process, and third-party ones under the entry-point group
``ucm_connector.sparse_methods`` (``NAME = "package.module:Class"``).

Validation of the ``sparse`` option goes through here, so that a bad name or
option stops start-up with a message, before any engine work.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any, Mapping

from .base import SparseConfigError, SparseMethod

ENTRY_POINT_GROUP = "ucm_connector.sparse_methods"

_BUILTIN: dict[str, str] = {
    "block_topk": "ucm_connector.sparse.block_topk:BlockTopK",
}
_REGISTERED: dict[str, type[SparseMethod]] = {}


def register_method(name: str, cls: type[SparseMethod]) -> None:
    """Make ``cls`` available as ``"method": name`` in this process."""
    if not (isinstance(cls, type) and issubclass(cls, SparseMethod)):
        raise TypeError(f"sparse method {name!r}: {cls!r} is not a SparseMethod subclass")
    _REGISTERED[name] = cls


def unregister_method(name: str) -> None:
    _REGISTERED.pop(name, None)


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def available_methods() -> list[str]:
    return sorted(set(_BUILTIN) | set(_REGISTERED) | set(_entry_points()))


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def method_class(name: str) -> type[SparseMethod]:
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name in _BUILTIN:
        return _load(_BUILTIN[name])
    eps = _entry_points()
    if name in eps:
        try:
            cls = eps[name].load()
        except Exception as exc:
            raise SparseConfigError(
                f"sparse-attention method {name!r} (entry point {eps[name].value!r}) "
                f"failed to load: {exc}") from None
        if not (isinstance(cls, type) and issubclass(cls, SparseMethod)):
            raise SparseConfigError(
                f"sparse-attention method {name!r}: entry point {eps[name].value!r} "
                "is not a SparseMethod subclass")
        return cls
    raise SparseConfigError(
        f"no sparse-attention method named {name!r}; available: {', '.join(available_methods())} "
        f"(third-party methods register under the entry-point group {ENTRY_POINT_GROUP!r})")


def _split(config: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    if not isinstance(config, Mapping) or not isinstance(config.get("method"), str):
        raise SparseConfigError(f"expected {{\"method\": NAME, ...options}}, got {config!r}")
    options = {k: v for k, v in config.items() if k != "method"}
    return config["method"], options


def validate(config: Mapping[str, Any]) -> dict[str, Any]:
    """Check the method name and its options; returns a plain copy."""
    name, options = _split(config)
    method_class(name).from_config(options)
    return {"method": name, **options}


def build_method(config: Mapping[str, Any]) -> SparseMethod:
    name, options = _split(config)
    return method_class(name).from_config(options)
