"""``disk://`` — KV blocks as files in a local directory, shared by processes.

URL::

    disk:///abs/path[?capacity=20GiB][&fsync=false][&touch_interval=1s]

* ``capacity``: the most value bytes the store keeps (file trailers of
  20 bytes + key length each come on top).  Putting past it evicts the
  least-recently-used blocks; a value larger than the capacity is refused.
  Without it the store is unbounded and puts fail (return ``False``) once the
  file system is full.  Give a capacity in production.  An operator's
  ``OpenMode.INSPECT`` reports it but never evicts.
* ``fsync`` (default ``false``): fsync each block and its directory before
  it is published.  Off, a power loss can lose recent blocks or leave blocks
  of the right length with zeroed bytes (the connector's block checksum
  catches those); a process crash never can.  The store is a cache, so the
  default favours speed.
* ``touch_interval`` (default ``1s``): how long a process may keep the
  access times of its hits to itself before writing them to the shared
  index.  A process always writes its own pending access times before it
  evicts, so LRU order is exact within a process and at most this stale
  across processes.

The package, one module per concern:

* ``layout``: where things are in a store's directory; ``is_disk_store``.
* ``block_files``: the block file format; publishing, reading, retiring and
  sweeping files.  Knows no index.
* ``index``: the shared SQLite index (schema, key mirror, access times,
  eviction order).  Knows no files.
* ``store``: ``DiskStore``, composing the two under the crash and
  concurrency rules, the capacity and the read-only mode of a full disk.

Nothing here knows what the bytes mean.
"""

from __future__ import annotations

# _MAGIC and _TRAILER: the file format, which tests read from here.
from .block_files import _MAGIC, _TRAILER, BlockRead, ReadStatus
from .layout import block_name, is_disk_store
from .store import DiskStore

__all__ = ["BlockRead", "DiskStore", "ReadStatus", "block_name", "is_disk_store"]
