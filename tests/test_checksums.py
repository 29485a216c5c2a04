"""Payload checksums on several threads (ucm_connector/checksums.py): the
same values as python-xxhash, in order, however the batch is split."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from ucm_connector import blockfmt, checksums


def _buffers(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]


@pytest.mark.parametrize("sizes", [[], [0], [1, 17, 240, 4099], [3 << 20] * 7 + [5, 1 << 20]],
                         ids=["none", "empty", "small", "large-batch"])
def test_checksums_equal_python_xxhash(sizes):
    buffers = _buffers(sizes)
    assert checksums.checksums(buffers) == [xxhash.xxh3_64_intdigest(b) for b in buffers]


def test_a_large_batch_is_split_over_threads_in_order(monkeypatch):
    """Shares of the batch go to the pool's threads; the answers come back
    in the order of the buffers."""
    seen = []
    hash_all = checksums._hash_all
    monkeypatch.setattr(checksums, "_hash_all", lambda share: (seen.append(len(share)), hash_all(share))[1])
    monkeypatch.setattr(checksums, "THREADS", 3)
    monkeypatch.setattr(checksums, "_pool", None)
    buffers = _buffers([1 << 20] * 11, seed=1)
    monkeypatch.setattr(checksums, "PARALLEL_MIN_NBYTES", 1)
    assert checksums.checksums(buffers) == [xxhash.xxh3_64_intdigest(b) for b in buffers]
    assert len(seen) == 3 and sum(seen) == 11


def test_small_payloads_stay_on_the_calling_thread(monkeypatch):
    """python-xxhash holds the GIL for small inputs: no threads for them."""
    monkeypatch.setattr(checksums, "_executor", lambda: pytest.fail("a pool was used"))
    monkeypatch.setattr(checksums, "PARALLEL_MIN_NBYTES", 1)
    buffers = _buffers([64 << 10] * 40)
    assert checksums.checksums(buffers) == [xxhash.xxh3_64_intdigest(b) for b in buffers]


def test_a_large_batch_really_uses_other_threads(monkeypatch):
    import threading

    names = set()
    hash_all = checksums._hash_all
    monkeypatch.setattr(checksums, "_hash_all",
                        lambda share: (names.add(threading.current_thread().name), hash_all(share))[1])
    monkeypatch.setattr(checksums, "THREADS", 2)
    monkeypatch.setattr(checksums, "_pool", None)
    buffers = _buffers([1 << 20] * 10, seed=2)
    assert checksums.checksums(buffers) == [xxhash.xxh3_64_intdigest(b) for b in buffers]
    assert any(name.startswith("ucm-checksum") for name in names), names


def test_verify_with_a_checksum_taken_beforehand_catches_a_damaged_payload():
    ns = b"n" * 16
    block = bytearray(blockfmt.encode_block(ns, bytes(range(200)), key=b"k"))
    payload = np.frombuffer(bytes(block[blockfmt.HEADER_NBYTES:]), dtype=np.uint8)
    (good,) = checksums.checksums([payload])
    blockfmt.verify(block, ns, 200, key=b"k", payload_checksum=good)
    block[blockfmt.HEADER_NBYTES + 3] ^= 1
    (bad,) = checksums.checksums([np.frombuffer(bytes(block[blockfmt.HEADER_NBYTES:]), dtype=np.uint8)])
    with pytest.raises(blockfmt.ChecksumMismatchError):
        blockfmt.verify(block, ns, 200, key=b"k", payload_checksum=bad)
