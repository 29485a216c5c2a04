"""Counting a store's blocks, and waiting until an engine's background
writes to it have settled."""

from __future__ import annotations

import time


def count_blocks(url: str) -> int:
    """Blocks held by the store at ``url`` (namespace manifests not counted)."""
    from store_backends import open_store
    from ucm_connector.manifest import is_manifest_key

    store = open_store(url)
    try:
        return sum(1 for keys in store.iter_keys() for key in keys if not is_manifest_key(key))
    finally:
        store.close()


def wait_quiet(url: str, *, min_blocks: int = 0, quiet_s: float = 0.6, timeout_s: float = 60.0) -> int:
    """Wait until the store holds at least ``min_blocks`` blocks and its
    block count has not changed for ``quiet_s``."""
    deadline = time.monotonic() + timeout_s
    last = count_blocks(url)
    since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = count_blocks(url)
        if now != last:
            last, since = now, time.monotonic()
        elif now >= min_blocks and time.monotonic() - since >= quiet_s:
            return now
    raise TimeoutError(f"store {url}: {last} blocks after {timeout_s} s "
                       f"(waited for >= {min_blocks} and no change for {quiet_s} s)")
