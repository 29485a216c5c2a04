"""Where things are in a disk store's directory, and whether a directory is one.

A store under ``root`` is::

    root/index.sqlite       the shared index (index.py), with its -wal and -shm files
    root/open.lock          taken while one process checks the index against the files
    root/00/ ... root/ff/   256 shard directories
    root/xx/<name>          one block file (block_files.py); ``name`` is the
                            32-hex-digit BLAKE2b-128 of the key, ``xx`` its first two digits

A key never becomes part of a path, so no key can name a file outside ``root``.

This module owns those names and ``is_disk_store``.  It must not open,
create or change anything: the block files and the index do that.
"""

from __future__ import annotations

import hashlib
import os

INDEX_FILE = "index.sqlite"
LOCK_FILE = "open.lock"
NAME_LEN = 32
SHARDS = tuple(f"{i:02x}" for i in range(256))


def block_name(key: bytes) -> str:
    """The file name of a key's block: fixed length, hex only."""
    return hashlib.blake2b(key, digest_size=16).hexdigest()


def block_path(root: str, name: str) -> str:
    return f"{root}/{name[:2]}/{name}"


def is_block_name(name: str, shard: str) -> bool:
    """Whether a file name in ``shard`` is a published block's (not a temp file)."""
    return len(name) == NAME_LEN and name.startswith(shard)


def is_disk_store(path: str) -> bool:
    """Whether ``path`` is a directory that holds a disk store: it has the
    index, or the shard directories (an index that was lost is rebuilt from
    the block files at the next open).  Looks only, like ``dbm.whichdb``;
    opens and creates nothing."""
    return os.path.isdir(path) and (os.path.exists(os.path.join(path, INDEX_FILE))
                                    or os.path.isdir(os.path.join(path, SHARDS[0])))
