"""The stored envelope of one KV block: a fixed 64-byte header, then the payload.

This module owns the bytes a store holds for one block and the checks made on
every load. It knows nothing of vLLM, torch or the stores: the payload is an
opaque run of bytes (one TP shard of one block, all layers), and a store is
never trusted to hand back what was put. Values are parsed with ``struct``
only; nothing here unpickles.

Layout (all integers little-endian)::

    offset  size  field
    ------  ----  -----------------------------------------------------------
         0     4  magic            b"UCMB"
         4     2  format version   u16, FORMAT_VERSION when written
         6     2  header nbytes    u16, 64 in version 1
         8     4  flags            u32, no flag is defined in version 1: must be 0
        12     4  reserved         u32, 0
        16    16  namespace digest Namespace.digest of the writer (hashing.py)
        32     8  payload nbytes   u64
        40     8  payload checksum xxh3_64 of the payload bytes
        48     8  key check        xxh3_64 of the store key the block was put under
        56     8  header checksum  xxh3_64 of header bytes [0, 56)
        64     n  payload          raw bytes, exactly ``payload nbytes`` of them

Why these choices:

* 64 bytes keep a payload that starts at an aligned buffer offset aligned to a
  cache line, so transfer code can view it as typed arrays without a copy.
* xxh3_64 checks a 1-4 MiB payload at memory speed (tens of GB/s here;
  ``benchmarks/hash_bench.py`` prints it), so every load can afford it. It
  guards against damage, not against an attacker who can write the store.
* The key check catches a store that returns another key's value (a renamed
  file, a bug in a tier): the checksum alone would pass such a block.
* The header checksum makes a flipped bit in the size or namespace a clean
  "header checksum mismatch" rather than a wrong-size read or a bogus reason.
* The version is checked before the header checksum, so a block written by a
  newer build says "upgrade" instead of looking corrupt.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"UCMB"
FORMAT_VERSION = 1
HEADER_NBYTES = 64
#: A namespace digest, and the content digest at the start of every block
#: key: xxh3-128 (hashing.py makes them; the envelope and manifests carry them).
DIGEST_NBYTES = 16

# magic, version, header nbytes, flags, reserved, namespace, payload nbytes,
# payload checksum, key check; the header checksum follows at 56.
_HEADER = struct.Struct("<4sHHII16sQQQ")
_HEADER_CHECKSUM = struct.Struct("<Q")
_CHECKED_NBYTES = _HEADER.size
assert _CHECKED_NBYTES + _HEADER_CHECKSUM.size == HEADER_NBYTES

_checksum = xxhash.xxh3_64_intdigest


class BlockFormatError(ValueError):
    """A stored block that must not be used. ``reason`` is a short, stable
    label (for counters and tests); the message adds the details."""

    reason = "bad block"

    def __init__(self, detail: str = ""):
        self.detail = detail
        super().__init__(f"{self.reason}: {detail}" if detail else self.reason)


class BadMagicError(BlockFormatError):
    reason = "bad magic"


class UnsupportedVersionError(BlockFormatError):
    """A version this build cannot read. Newer versions are the common case
    (a newer engine shares the store), and the message says what to do."""

    reason = "unsupported format version"

    def __init__(self, version: int):
        self.version = version
        if version > FORMAT_VERSION:
            self.reason = "newer format version"
            self.detail = f"{version} (this build reads up to {FORMAT_VERSION})"
            ValueError.__init__(self, f"newer format version {self.detail}: upgrade ucm-connector")
        else:
            super().__init__(f"{version} (this build reads 1 to {FORMAT_VERSION})")


class HeaderChecksumError(BlockFormatError):
    reason = "header checksum mismatch"


class UnsupportedFlagsError(BlockFormatError):
    reason = "unsupported flags"


class NamespaceMismatchError(BlockFormatError):
    reason = "namespace mismatch"


class KeyMismatchError(BlockFormatError):
    reason = "key mismatch"


class SizeMismatchError(BlockFormatError):
    reason = "size mismatch"


class ChecksumMismatchError(BlockFormatError):
    reason = "checksum mismatch"


@dataclass(frozen=True)
class BlockHeader:
    """The fields of a header whose magic, version and checksum were checked."""

    version: int
    header_nbytes: int
    flags: int
    namespace_digest: bytes
    payload_nbytes: int
    payload_checksum: int
    key_check: int


def block_nbytes(payload_nbytes: int) -> int:
    """Stored size of a block with a payload of ``payload_nbytes``."""
    return HEADER_NBYTES + payload_nbytes


def key_check(key: bytes) -> int:
    """The 64-bit value stored for ``key`` in the header."""
    return _checksum(key)


def _byte_view(buf) -> memoryview:
    view = memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _check_namespace_digest(namespace_digest: bytes) -> None:
    if len(namespace_digest) != DIGEST_NBYTES:
        raise ValueError(
            f"namespace digest must be {DIGEST_NBYTES} bytes, "
            f"got {len(namespace_digest)}")


def _pack_header(namespace_digest: bytes, payload_nbytes: int, payload_checksum: int,
                 key: bytes) -> bytes:
    _check_namespace_digest(namespace_digest)
    if payload_nbytes < 0:
        raise ValueError(f"payload_nbytes must be >= 0, got {payload_nbytes}")
    body = _HEADER.pack(MAGIC, FORMAT_VERSION, HEADER_NBYTES, 0, 0, bytes(namespace_digest),
                        payload_nbytes, payload_checksum, key_check(key))
    return body + _HEADER_CHECKSUM.pack(_checksum(body))


def encode_header(namespace_digest: bytes, payload, key: bytes = b"") -> bytes:
    """The 64-byte header for ``payload`` (any contiguous buffer), so a caller
    can write header and payload as two pieces without joining them."""
    view = _byte_view(payload)
    return _pack_header(namespace_digest, view.nbytes, _checksum(view), key)


def pack_into(buf, namespace_digest: bytes, payload_nbytes: int, key: bytes = b"") -> None:
    """Write the header into ``buf[:HEADER_NBYTES]`` for the payload the
    caller already placed at ``buf[HEADER_NBYTES:HEADER_NBYTES + payload_nbytes]``.

    The point is one preallocated buffer per block: the transfer code gathers
    KV straight into its payload part and no copy is made to add the header.
    """
    view = _block_buffer(buf, payload_nbytes, "pack_into")
    header = _pack_header(namespace_digest, payload_nbytes,
                          _checksum(view[HEADER_NBYTES:HEADER_NBYTES + payload_nbytes]), key)
    view[:HEADER_NBYTES] = header


def _block_buffer(buf, payload_nbytes: int, caller: str) -> memoryview:
    """A writable byte view of ``buf``, checked to hold the header and a
    ``payload_nbytes``-byte payload."""
    view = _byte_view(buf)
    if view.readonly:
        raise ValueError(f"{caller} needs a writable buffer")
    if view.nbytes < HEADER_NBYTES + payload_nbytes:
        raise ValueError(
            f"buffer of {view.nbytes} bytes is too small for a {payload_nbytes}-byte payload "
            f"plus the {HEADER_NBYTES}-byte header")
    return view


def payload_hasher() -> "xxhash.xxh3_64":
    """A streaming hash of a payload fed in pieces: its ``intdigest()`` is
    the header's payload checksum, so a copy can checksum each piece while
    the piece is in the CPU's caches (``pack_header_into`` then seals)."""
    return xxhash.xxh3_64()


def header_bytes(namespace_digest: bytes, payload_nbytes: int, payload_checksum: int, key: bytes = b"") -> bytes:
    """The 64-byte header of a payload whose checksum the caller already
    took (``payload_hasher``), for a block written as header and payload
    pieces."""
    return _pack_header(namespace_digest, payload_nbytes, payload_checksum, key)


def pack_header_into(buf, namespace_digest: bytes, payload_nbytes: int, payload_checksum: int,
                     key: bytes = b"") -> None:
    """``pack_into`` for a payload whose checksum the caller already took
    (``payload_hasher``) as it placed the payload in ``buf``."""
    view = _block_buffer(buf, payload_nbytes, "pack_header_into")
    view[:HEADER_NBYTES] = _pack_header(namespace_digest, payload_nbytes, payload_checksum, key)


def encode_block(namespace_digest: bytes, payload, key: bytes = b"") -> bytes:
    """Header and payload as one ``bytes`` (one copy of the payload); for
    callers that hold the payload separately and need a single value."""
    view = _byte_view(payload)
    return encode_header(namespace_digest, view, key) + view.tobytes()


def parse_header(buf) -> BlockHeader:
    """Check magic, version and header checksum and return the header fields.
    Does not look at the payload; ``verify`` does."""
    view = _byte_view(buf)
    if view.nbytes < len(MAGIC) or view[:len(MAGIC)] != MAGIC:
        raise BadMagicError(f"first bytes {bytes(view[:len(MAGIC)])!r}, expected {MAGIC!r}")
    if view.nbytes < HEADER_NBYTES:
        raise SizeMismatchError(
            f"{view.nbytes} bytes is shorter than the {HEADER_NBYTES}-byte header")
    (_, version, header_nbytes, flags, _, namespace_digest, payload_nbytes,
     payload_checksum, stored_key_check) = _HEADER.unpack_from(view)
    if version != FORMAT_VERSION:
        raise UnsupportedVersionError(version)
    (header_checksum,) = _HEADER_CHECKSUM.unpack_from(view, _CHECKED_NBYTES)
    if header_checksum != _checksum(view[:_CHECKED_NBYTES]):
        raise HeaderChecksumError("the header was damaged")
    if header_nbytes != HEADER_NBYTES:
        raise SizeMismatchError(
            f"header says {header_nbytes} header bytes, version {version} has {HEADER_NBYTES}")
    if flags:
        raise UnsupportedFlagsError(f"0x{flags:x} (this build knows none): upgrade ucm-connector")
    return BlockHeader(version, header_nbytes, flags, namespace_digest, payload_nbytes,
                       payload_checksum, stored_key_check)


def verify(buf, namespace_digest: bytes, expected_payload_nbytes: int | None = None, *,
           key: bytes | None = None, payload_checksum: int | None = None) -> memoryview:
    """Check a stored block and return a view of its payload (no copy).

    Raises a ``BlockFormatError`` subclass on any problem. ``buf`` must hold
    exactly one block: stores copy whole values (``get_into`` fails on a size
    difference), so a longer buffer is as suspect as a shorter one. ``key``,
    when given, must be the key the block was packed with.
    ``payload_checksum``: the xxh3_64 of ``buf[HEADER_NBYTES:]``, taken by
    the caller (``checksums.py`` takes a batch's on several threads).
    """
    view = _byte_view(buf)
    header = _checked_header(view, namespace_digest, expected_payload_nbytes, key)
    end = HEADER_NBYTES + header.payload_nbytes
    if view.nbytes != end:
        raise SizeMismatchError(
            f"{view.nbytes} bytes stored for a {header.payload_nbytes}-byte payload "
            f"({end} bytes with the header)")
    payload = view[HEADER_NBYTES:end]
    if (_checksum(payload) if payload_checksum is None else payload_checksum) != header.payload_checksum:
        raise ChecksumMismatchError("the payload was damaged")
    return payload


def verify_parts(header, payload_parts, namespace_digest: bytes, expected_payload_nbytes: int | None = None, *,
                 key: bytes | None = None) -> None:
    """``verify`` for a block read in pieces: ``header`` holds its first
    ``HEADER_NBYTES`` bytes and ``payload_parts`` the payload, in order (a
    block read straight into the pages it is used in).  Raises the same
    errors as ``verify``."""
    view = _byte_view(header)
    if view.nbytes != HEADER_NBYTES:
        raise SizeMismatchError(f"{view.nbytes} header bytes, expected {HEADER_NBYTES}")
    checked = _checked_header(view, namespace_digest, expected_payload_nbytes, key)
    h = payload_hasher()
    total = 0
    for part in payload_parts:
        part = _byte_view(part)
        h.update(part)
        total += part.nbytes
    if total != checked.payload_nbytes:
        raise SizeMismatchError(
            f"{total} payload bytes read for a {checked.payload_nbytes}-byte payload")
    if h.intdigest() != checked.payload_checksum:
        raise ChecksumMismatchError("the payload was damaged")


def _checked_header(view: memoryview, namespace_digest: bytes, expected_payload_nbytes: int | None,
                    key: bytes | None) -> BlockHeader:
    """The parsed header, checked against what the reader expects."""
    _check_namespace_digest(namespace_digest)
    header = parse_header(view)
    if header.namespace_digest != namespace_digest:
        raise NamespaceMismatchError(
            f"block written for namespace {header.namespace_digest.hex()}, "
            f"this engine reads {bytes(namespace_digest).hex()}")
    if key is not None and header.key_check != key_check(key):
        raise KeyMismatchError(f"block was not stored under key {bytes(key).hex()}")
    if expected_payload_nbytes is not None and header.payload_nbytes != expected_payload_nbytes:
        raise SizeMismatchError(
            f"header says a {header.payload_nbytes}-byte payload, "
            f"expected {expected_payload_nbytes}")
    return header
