"""URL scheme -> store class, for built-in and third-party stores.

A third-party store registers its scheme under the entry-point group
``ucm_connector.stores``::

    [project.entry-points."ucm_connector.stores"]
    mystore = "my_package.module:MyStore"

The object an entry point names is either a ``KVStore`` subclass with a
``from_url(url)`` class method or any callable ``url -> KVStore``.  It is
then opened exactly like a built-in store: ``open_store("mystore://...")``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import threading
from typing import Callable, Sequence

from .base import KVStore, OpenMode, StoreOpenError
from .urls import mask_password, split_url

ENTRY_POINT_GROUP = "ucm_connector.stores"

_BUILTIN: dict[str, str] = {
    "disk": "store_backends.disk:DiskStore",
    "redis": "store_backends.redis:RedisStore",
    "rediss": "store_backends.redis:RedisStore",
    "unix": "store_backends.redis:RedisStore",
    "redis-cluster": "store_backends.redis:RedisClusterStore",
    "shm": "store_backends.shm:ShmStore",
}

_registered: dict[str, Callable[[str], KVStore]] = {}
_lock = threading.Lock()


def register_scheme(scheme: str, opener: object) -> None:
    """Register ``opener`` (a KVStore class with ``from_url`` or a callable
    ``url -> KVStore``) under ``scheme`` for this process."""
    with _lock:
        _registered[scheme.lower()] = _as_factory(opener, scheme)


def _as_factory(obj: object, scheme: str) -> Callable[[str], KVStore]:
    from_url = getattr(obj, "from_url", None)
    if callable(from_url):
        return from_url
    if callable(obj):
        return obj  # type: ignore[return-value]
    raise StoreOpenError(f"the store registered for scheme {scheme!r} is neither a KVStore class nor a callable")


def _load(target: str) -> object:
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr) if attr else module


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name.lower(): ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def known_schemes() -> list[str]:
    return sorted(set(_BUILTIN) | set(_registered) | set(_entry_points()))


def factory_for(scheme: str, url: str = "") -> Callable[[str], KVStore]:
    scheme = scheme.lower()
    with _lock:
        if scheme in _registered:
            return _registered[scheme]
    if scheme in _BUILTIN:
        factory = _as_factory(_load(_BUILTIN[scheme]), scheme)
    else:
        ep = _entry_points().get(scheme)
        if ep is None:
            raise _unknown_scheme(scheme, url)
        try:
            factory = _as_factory(ep.load(), scheme)
        except StoreOpenError:
            raise
        except Exception as exc:
            raise StoreOpenError(
                f"store '{mask_password(url)}': the entry point {ep.value!r} for scheme {scheme!r} "
                f"failed to load: {exc}") from exc
    with _lock:
        _registered.setdefault(scheme, factory)
        return _registered[scheme]


def _unknown_scheme(scheme: str, url: str) -> StoreOpenError:
    return StoreOpenError(
        f"store '{mask_password(url)}': unknown scheme {scheme!r}; "
        f"known schemes: {', '.join(known_schemes())} "
        f"(third-party stores register under the entry-point group {ENTRY_POINT_GROUP!r})")


def check_scheme(url: str) -> str:
    """The scheme of ``url`` where a store is known for it (built in,
    registered or an entry point), else ``StoreOpenError`` naming the known
    ones, as ``open_store`` would; opens and loads nothing."""
    scheme = url_scheme(url)
    if scheme not in known_schemes():
        raise _unknown_scheme(scheme, url)
    return scheme


def url_scheme(url: str) -> str:
    if not isinstance(url, str):
        raise StoreOpenError(
            f"a store URL must be a string, got {type(url).__name__}: {mask_password(repr(url))}")
    scheme, sep, _ = url.partition("://")
    if not sep or not scheme:
        raise StoreOpenError(
            f"store '{mask_password(url)}' is not a URL: write it as scheme://..., "
            f"for example disk:///var/cache/ucm, redis://localhost:6379/0 or shm://ucm")
    split_url(url)
    return scheme.lower()


def open_store(url: str | Sequence[str], mode: OpenMode | str = OpenMode.SERVE,
               **tier_options: object) -> KVStore:
    """Open the store a URL names; a list of URLs opens a tier of stores,
    fastest first (``tier_options`` go to ``TieredStore``).  ``mode``:
    ``OpenMode.SERVE`` for an engine, ``OpenMode.INSPECT`` for an operator
    (see ``OpenMode``); a third-party store whose opener takes no ``mode``
    is opened as it is."""
    mode = OpenMode(mode)
    if isinstance(url, (list, tuple)):
        from .tiered import TieredStore

        if not url:
            raise StoreOpenError("an empty list of store URLs names no store")
        if len(url) == 1 and not tier_options:
            return open_store(url[0], mode)
        stores: list[KVStore] = []
        try:
            for one in url:
                stores.append(open_store(one, mode))
        except BaseException:
            for store in stores:
                store.close()
            raise
        return TieredStore(stores, **tier_options)  # type: ignore[arg-type]
    if tier_options:
        raise TypeError(f"tier options {sorted(tier_options)} only apply to a list of store URLs")
    scheme = url_scheme(url)
    factory = factory_for(scheme, url)
    if mode is not OpenMode.SERVE and _takes_mode(factory):
        return factory(url, mode=mode)  # type: ignore[call-arg]
    return factory(url)


def _takes_mode(factory: Callable) -> bool:
    try:
        return "mode" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def which_store(url: str) -> str | None:
    """The kind of store a URL names if one exists there (like
    ``dbm.whichdb``): ``"disk"`` for a directory holding a disk store,
    ``"shm"`` for a running shm server, the scheme for a reachable Redis or
    third-party store; None when nothing is there.  Opens nothing for
    writing and starts nothing; raises ``StoreOpenError`` for a bad URL."""
    try:
        with open_store(url, OpenMode.INSPECT) as store:
            return store.stats().kind or url_scheme(url)
    except StoreOpenError:
        url_scheme(url)   # a malformed URL still raises
        return None
