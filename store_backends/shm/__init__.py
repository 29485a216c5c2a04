"""``shm://NAME``: a store in shared memory for all processes of a host.

One index server per NAME and host owns the index; the values live in a
/dev/shm segment that every client maps.  The modules, one idea each:

* ``protocol``: the wire format (op codes, flags and statuses as enums, the
  header structs, how keys are framed);
* ``paths``: where a store's files live, valid NAMEs, the runtime directory
  check, and whether a server runs (its PID lock);
* ``index``: the server's state (the LRU index, free chunks, leases) and
  the ops that read and change it;
* ``server``: the index server process and its command line
  (``python -m store_backends.shm_server serve|status|stop NAME``);
* ``client``: ``ShmStore``, the KVStore that engines and operators open
  through ``open_store("shm://NAME...")``: the store's operations;
* ``connection``: a client's sockets, deadlines and reconnects;
* ``launch``: a client starting a server;
* ``segments``: a client mapping a server's segments, with the checks;
* ``keytable``: the key fingerprints a server publishes, so that lookups
  need no request;
* ``locations``: where stored values live, published beside the key table,
  so that gets need no request;
* ``uses``: the gets and late misses a client owes its server's counters;
* ``copies``: copying values between buffers and the data segment;
* ``admin``: the public admin API for operators: ``list_servers``,
  ``server_running``, ``server_status`` (a ``ServerStatus``),
  ``stop_server``, ``check_runtime_dir``, ``valid_name``.

This package knows nothing of vLLM, torch, or what the values mean.
"""

from .admin import (ServerStatus, check_runtime_dir, list_servers, server_running, server_status, stop_server,
                    valid_name)
from .client import ShmStore
from .paths import ShmServerNotRunning, UnsafeRuntimeDir

__all__ = [
    "ServerStatus",
    "ShmServerNotRunning",
    "ShmStore",
    "UnsafeRuntimeDir",
    "check_runtime_dir",
    "list_servers",
    "server_running",
    "server_status",
    "stop_server",
    "valid_name",
]
