"""The wire protocol between an shm client and its index server.

Owns what goes over the control socket: the op codes, flags and statuses
(``IntEnum``/``IntFlag``, so a number on the wire has a name in code and in
tracebacks), the fixed request and reply headers, how a batch of keys is
framed, and the defaults both ends agree on.  Must not do I/O, know where
files live (``paths``), or hold state: the server (``server``) and the client
(``client``) are the two ends that speak it.

Wire format (all integers little-endian).  A request is a message of
frames (framed on the socket as ``transport`` says):
frame 0 is the header ``REQUEST`` = op u8, flags u8, key_len u16, request_id
u32, epoch u64, arg i64; then, for ops that take keys, the keys as one frame
(concatenated) and, when key_len is 0 (keys of different lengths), a frame of
u32 key lengths; ALLOC adds a frame of i64 value sizes (and, flagged ``TOUCHED``, a
``TOUCH_COUNTS`` frame and the touched keys' frames; flagged ``RELEASE``, a
reservation to give back).  DECLARE is laid out as ALLOC, its arg the
reservation's lease, and gets no reply; COMMIT flagged ``RESERVE`` ends
with the sizes to reserve for the next put.  TOUCH is a
``TOUCH_COUNTS`` frame, then the touched keys' frames; its arg carries
late misses, as GET's does.  A reply is frame 0
``REPLY`` = status u8, 3 pad bytes, request_id u32, epoch u64, then the op's
result frames (see the ``op_*`` methods of ``index.ChunkIndex`` and the
server's own ``_op_*``).  A request whose epoch is not the server's is
answered ``Status.STALE`` so the client remaps before it uses any chunk
number.
"""

from __future__ import annotations

import array
import enum
import struct

import numpy as np

PROTOCOL_VERSION = 2     # 2: framed messages over a plain unix socket (``transport``), not ZeroMQ
DEFAULT_CHUNK_NBYTES = 64 * 1024
DEFAULT_LEASE_TIMEOUT_S = 600.0

REQUEST = struct.Struct("<BBHIQq")
REPLY = struct.Struct("<BxxxIQ")
#: The counts of a TOUCH: key_len of its keys, gets, hits.
TOUCH_COUNTS = struct.Struct("<qqq")
#: A reservation's lease (0: none was made).
RESERVATION = struct.Struct("<q")
#: A reservation given back (``Flag.RELEASE``): the epoch it was made in, its lease.
RELEASED = struct.Struct("<Qq")


class Op(enum.IntEnum):
    """What a request asks for (the ``op`` byte of ``REQUEST``)."""

    HELLO = 1
    CONTAINS = 2
    PREFIX = 3
    GET = 4
    ALLOC = 5
    COMMIT = 6
    ABORT = 7
    DELETE = 8
    STATS = 9
    CLEAR = 10
    SHUTDOWN = 11
    KEYS = 12
    #: Uses of keys a client read without asking (from published
    #: locations): LRU moves and the get counters.
    TOUCH = 13
    #: Name the keys of the values being copied into a reservation (chunks
    #: a COMMIT flagged ``RESERVE`` handed out for the next put), which
    #: makes it a lease of those keys for COMMIT.  Not answered: sent
    #: ahead of the copies, so that a put makes one round trip.
    DECLARE = 14


#: Ops that get no reply (not even an error or ``Status.STALE``: what
#: follows them on the socket is answered instead).
NO_REPLY_OPS = frozenset({Op.DECLARE})
#: Ops that do not depend on the segments a client has mapped.
EPOCH_FREE_OPS = frozenset({Op.HELLO, Op.STATS, Op.CLEAR, Op.SHUTDOWN, Op.DELETE, Op.CONTAINS, Op.PREFIX,
                            Op.KEYS, Op.TOUCH})


class Flag(enum.IntFlag):
    """The ``flags`` byte of ``REQUEST``.  A server ignores flags it does
    not know, so a new flag must be safe to ignore."""

    #: ALLOC: replace a stored value instead of keeping it.
    OVERWRITE = 1
    #: GET for inspection: neither a use for LRU nor a get in the counters.
    NO_TOUCH = 2
    #: ALLOC: the frames after the sizes carry uses, as TOUCH does (a
    #: TOUCH_COUNTS frame, then the keys), applied before allocating.
    TOUCHED = 4
    #: COMMIT: the last frame holds the value sizes (i64) of the writer's
    #: next put; reserve chunks for it from free ones, never by evicting,
    #: and answer ``RESERVATION`` (lease 0: none), run counts and runs as
    #: ALLOC does.
    RESERVE = 8
    #: ALLOC: the last frame is a reservation the writer will not use
    #: (``RELEASED``); released before allocating.
    RELEASE = 16


class Status(enum.IntEnum):
    """The ``status`` byte of ``REPLY``."""

    OK = 0
    #: The request's epoch is not the server's: remap, then retry.
    STALE = 1
    #: The request was malformed; frame 1 says why.
    ERROR = 2
    #: COMMIT of a lease the server no longer holds (reclaimed).
    LEASE_GONE = 3


class Alloc(enum.IntEnum):
    """Per key, in the reply to ALLOC."""

    NEW = 0        # chunks handed out: copy the value in, then COMMIT
    PRESENT = 1    # already stored (and not overwritten): nothing to copy
    FAILED = 2     # no room: the put of this key fails


#: Exit status of ``serve --detach`` when a server of NAME already runs.
EXIT_ALREADY_RUNNING = 3


def pack_keys(keys) -> tuple[int, list[bytes]]:
    """(key_len, frames): one blob when every key has the same length (the
    common case: content addresses), else the blob and a u32 length array."""
    n = len(keys)
    if n == 0:
        return 0, [b"", b""]
    try:
        blob = b"".join(keys)
    except TypeError:
        from ..base import check_batch
        check_batch(keys)
        raise
    first = len(keys[0])
    lens = list(map(len, keys))
    if 0 < first < 0x10000 and len(blob) == n * first and lens.count(first) == n:
        return first, [blob]
    if 0 in lens:
        raise ValueError("store keys must not be empty")
    return 0, [blob, array.array("I", lens).tobytes()]


def unpack_keys(key_len: int, frames: list[bytes]) -> tuple[list[bytes], int]:
    """The keys and how many frames they took."""
    blob = frames[0]
    if key_len:
        if len(blob) % key_len:
            raise ValueError("key blob is not a multiple of the key length")
        if not blob:
            return [], 1
        return np.frombuffer(blob, np.dtype((np.void, key_len))).tolist(), 1
    blob = bytes(blob)
    lens = np.frombuffer(frames[1], np.uint32)
    if int(lens.sum(dtype=np.int64)) != len(blob):
        raise ValueError("key lengths do not add up to the key blob")
    ends = np.cumsum(lens, dtype=np.int64).tolist()
    starts = [0] + ends[:-1]
    return [blob[s:e] for s, e in zip(starts, ends)], 2
