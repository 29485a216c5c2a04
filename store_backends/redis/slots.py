"""Redis Cluster slot hashing: which of the 16384 slots each key falls in.

This module owns the CRC16-XMODEM arithmetic, vectorised over a batch of
keys, with the exact per-key rule of redis-py (``redis.crc.key_slot``) for
the keys it does not vectorise.  It must not know which node owns a slot
(that is the cluster store's slot map) and does no I/O.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from redis.crc import key_slot

NUM_SLOTS = 16384


def _crc16_tables() -> tuple[np.ndarray, np.ndarray]:
    """CRC16-XMODEM tables: one byte at a time, and two bytes at a time
    (the 16-bit register is shifted out whole, so the next state is a
    function of ``state ^ word`` alone)."""
    byte_table = np.zeros(256, dtype=np.int32)
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
        byte_table[byte] = crc & 0xFFFF
    state = np.arange(65536, dtype=np.int32)
    for _ in range(2):
        state = ((state << 8) & 0xFFFF) ^ byte_table[state >> 8]
    return byte_table, state.astype(np.uint16)


_CRC16, _CRC16_WORD = _crc16_tables()
_LBRACE = ord("{")
_RBRACE = ord("}")


def slots_of(prefix: bytes, keys: Sequence[bytes]) -> np.ndarray:
    """The cluster slot of ``prefix + key`` for each key (CRC16-XMODEM of
    the key, or of its ``{hash tag}``, modulo 16384), computed for all keys
    at once: a per-key Python loop costs milliseconds on thousands of keys.
    The namespace prefix has no braces, so a key without ``{`` is hashed
    whole; keys with one take the exact per-key rule."""
    n = len(keys)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    width = len(keys[0])
    if n < 32 or width == 0 or len(set(map(len, keys))) != 1:
        return np.fromiter((key_slot(prefix + k) for k in keys), dtype=np.int64, count=n)
    joined = b"".join(keys)
    rows = np.frombuffer(joined, dtype=np.uint8).reshape(n, width)
    crc = 0
    for byte in prefix:
        crc = ((crc << 8) & 0xFFFF) ^ int(_CRC16[((crc >> 8) ^ byte) & 0xFF])
    start = 0
    if width % 2:
        first = ((crc << 8) & 0xFFFF) ^ _CRC16.take((crc >> 8) ^ rows[:, 0].astype(np.int32))
        state = first.astype(np.uint16)
        start = 1
    else:
        state = np.full(n, crc, dtype=np.uint16)
    # One row per 16-bit column, so that each step reads contiguous memory.
    columns = np.ascontiguousarray(np.ascontiguousarray(rows[:, start:]).view(">u2").astype(np.uint16).T)
    for column in columns:
        state = _CRC16_WORD.take(state ^ column)
    slots = (state & 0x3FFF).astype(np.int64)
    if b"{" in joined and b"}" in joined:
        # Only a key with both braces can hold a hash tag.
        flat = rows.reshape(-1)
        tagged = np.intersect1d(np.flatnonzero(flat == _LBRACE) // width,
                                np.flatnonzero(flat == _RBRACE) // width)
        for i in tagged.tolist():
            slots[i] = key_slot(prefix + keys[i])
    return slots
