"""The stored block envelope: round trips, and every kind of damage caught with its reason."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from ucm_connector import blockfmt
from ucm_connector.blockfmt import (
    FORMAT_VERSION,
    HEADER_NBYTES,
    BlockFormatError,
    block_nbytes,
    encode_block,
    encode_header,
    pack_into,
    parse_header,
    pack_header_into,
    payload_hasher,
    verify,
    verify_parts,
)

NAMESPACE = bytes(range(16))
OTHER_NAMESPACE = bytes(range(1, 17))
KEY = b"k" * 18


def payload(nbytes: int = 64 * 1024, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def packed_block(data: bytes, namespace: bytes = NAMESPACE, key: bytes = KEY) -> bytearray:
    buf = bytearray(block_nbytes(len(data)))
    buf[HEADER_NBYTES:] = data
    pack_into(buf, namespace, len(data), key=key)
    return buf


def reason_of(buf, namespace=NAMESPACE, expected=None, key=KEY) -> str:
    with pytest.raises(BlockFormatError) as info:
        verify(buf, namespace, expected, key=key)
    return info.value.reason


def test_header_is_64_bytes_so_payloads_stay_aligned():
    assert HEADER_NBYTES == 64
    assert len(encode_header(NAMESPACE, b"abc")) == HEADER_NBYTES


def test_round_trip_returns_the_payload_bytes():
    data = payload()
    buf = packed_block(data)
    view = verify(buf, NAMESPACE, len(data), key=KEY)
    assert bytes(view) == data


def test_verify_returns_a_view_into_the_buffer_not_a_copy():
    buf = packed_block(payload(4096))
    view = verify(buf, NAMESPACE, 4096)
    buf[HEADER_NBYTES] ^= 0xFF
    assert view[0] == buf[HEADER_NBYTES]


def test_header_plus_payload_written_separately_equals_pack_into():
    data = payload()
    assert encode_header(NAMESPACE, data, key=KEY) + data == bytes(packed_block(data))
    assert encode_block(NAMESPACE, data, key=KEY) == bytes(packed_block(data))


def test_a_checksum_taken_in_pieces_seals_the_same_header_as_pack_into():
    data = payload(100_000, seed=4)
    whole = bytearray(HEADER_NBYTES + len(data))
    whole[HEADER_NBYTES:] = data
    pack_into(whole, NAMESPACE, len(data), key=KEY)
    h = payload_hasher()
    for lo in range(0, len(data), 30_000):
        h.update(data[lo:lo + 30_000])
    pieces = bytearray(whole)
    pieces[:HEADER_NBYTES] = bytes(HEADER_NBYTES)
    pack_header_into(pieces, NAMESPACE, len(data), h.intdigest(), key=KEY)
    assert pieces == whole
    with pytest.raises(ValueError, match="too small"):
        pack_header_into(bytearray(10), NAMESPACE, len(data), 0)


def test_pack_into_a_numpy_buffer_and_verify_from_bytes():
    data = payload(8192)
    buf = np.zeros(block_nbytes(len(data)), dtype=np.uint8)
    buf[HEADER_NBYTES:] = np.frombuffer(data, dtype=np.uint8)
    pack_into(buf, NAMESPACE, len(data), key=KEY)
    assert bytes(verify(buf.tobytes(), NAMESPACE, len(data), key=KEY)) == data


def test_empty_payload_round_trips():
    assert bytes(verify(packed_block(b""), NAMESPACE, 0, key=KEY)) == b""


def test_parse_header_reports_the_fields():
    data = payload(1000)
    header = parse_header(packed_block(data))
    assert header.version == FORMAT_VERSION
    assert header.namespace_digest == NAMESPACE
    assert header.payload_nbytes == 1000
    assert header.key_check == blockfmt.key_check(KEY)


def test_flipped_payload_byte_is_a_checksum_mismatch():
    buf = packed_block(payload())
    buf[HEADER_NBYTES + 12345] ^= 0x01
    assert reason_of(buf) == "checksum mismatch"


def test_flipped_last_payload_byte_is_a_checksum_mismatch():
    buf = packed_block(payload())
    buf[-1] ^= 0x80
    assert reason_of(buf) == "checksum mismatch"


@pytest.mark.parametrize("offset", [8, 12, 16, 31, 32, 40, 48, 56, 63])
def test_flipped_header_byte_is_a_header_checksum_mismatch(offset):
    buf = packed_block(payload(4096))
    buf[offset] ^= 0x04
    assert reason_of(buf) == "header checksum mismatch"


def test_flipped_magic_byte_is_bad_magic():
    buf = packed_block(payload(4096))
    buf[0] ^= 0x01
    assert reason_of(buf) == "bad magic"


def test_a_value_that_is_not_a_block_is_bad_magic():
    assert reason_of(b"\x80\x04\x95pickle-looking bytes" + bytes(100)) == "bad magic"
    assert reason_of(b"") == "bad magic"


@pytest.mark.parametrize("cut", [1, 1000, 4096])
def test_truncated_payload_is_a_size_mismatch(cut):
    buf = packed_block(payload(4096))
    assert reason_of(buf[:-cut]) == "size mismatch"


def test_truncated_header_is_a_size_mismatch():
    assert reason_of(packed_block(payload(4096))[:40]) == "size mismatch"


def test_trailing_bytes_are_a_size_mismatch():
    assert reason_of(packed_block(payload(4096)) + b"\0") == "size mismatch"


def test_unexpected_payload_size_is_a_size_mismatch():
    buf = packed_block(payload(4096))
    assert reason_of(buf, expected=8192) == "size mismatch"


def test_block_of_another_namespace_is_a_namespace_mismatch():
    buf = packed_block(payload(4096), namespace=OTHER_NAMESPACE)
    assert reason_of(buf) == "namespace mismatch"


def test_block_stored_under_another_key_is_a_key_mismatch():
    buf = packed_block(payload(4096), key=b"another key")
    assert reason_of(buf) == "key mismatch"
    assert bytes(verify(buf, NAMESPACE, 4096, key=b"another key")) == payload(4096)


def rewrite_header(buf: bytearray, **fields) -> None:
    """Change header fields and re-seal the header checksum, as a writer of
    that version would."""
    names = ["magic", "version", "header_nbytes", "flags", "reserved", "namespace",
             "payload_nbytes", "payload_checksum", "key_check"]
    values = dict(zip(names, blockfmt._HEADER.unpack_from(buf)))
    values.update(fields)
    blockfmt._HEADER.pack_into(buf, 0, *(values[n] for n in names))
    struct.pack_into("<Q", buf, 56, blockfmt._checksum(bytes(buf[:56])))


def test_newer_format_version_says_to_upgrade():
    buf = packed_block(payload(4096))
    rewrite_header(buf, version=FORMAT_VERSION + 1)
    with pytest.raises(blockfmt.UnsupportedVersionError) as info:
        verify(buf, NAMESPACE, 4096)
    assert info.value.reason == "newer format version"
    assert str(info.value) == (f"newer format version {FORMAT_VERSION + 1} (this build reads up "
                               f"to {FORMAT_VERSION}): upgrade ucm-connector")


def test_newer_format_version_is_reported_even_if_its_header_differs():
    # A newer version may move the header checksum; the version alone decides.
    buf = packed_block(payload(4096))
    struct.pack_into("<H", buf, 4, FORMAT_VERSION + 3)
    assert reason_of(buf) == "newer format version"


def test_version_zero_is_unsupported():
    buf = packed_block(payload(4096))
    rewrite_header(buf, version=0)
    assert reason_of(buf) == "unsupported format version"


def test_unknown_flags_are_refused():
    buf = packed_block(payload(4096))
    rewrite_header(buf, flags=1)
    assert reason_of(buf) == "unsupported flags"


def test_errors_are_value_errors_with_the_reason_first():
    buf = packed_block(payload(4096), namespace=OTHER_NAMESPACE)
    with pytest.raises(ValueError, match=r"^namespace mismatch: "):
        verify(buf, NAMESPACE)


def test_pack_into_refuses_a_buffer_too_small_or_read_only():
    with pytest.raises(ValueError, match="too small"):
        pack_into(bytearray(HEADER_NBYTES + 10), NAMESPACE, 11)
    with pytest.raises(ValueError, match="writable"):
        pack_into(bytes(HEADER_NBYTES + 10), NAMESPACE, 10)


def test_namespace_digest_must_be_16_bytes():
    with pytest.raises(ValueError, match="16 bytes"):
        encode_header(b"short", b"data")


# -- properties: no damage is ever accepted, no input ever crashes ------------------------------

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
payloads = st.binary(max_size=300)
keys = st.binary(min_size=1, max_size=32)


def verify_outcome(buf, namespace=NAMESPACE, expected=None, key=KEY):
    """The payload ``verify`` accepts, or the BlockFormatError it raises;
    any other exception fails the test."""
    try:
        return bytes(verify(buf, namespace, expected, key=key))
    except BlockFormatError as exc:
        return exc


@PROPERTY
@given(payloads, keys, st.data())
def test_any_changed_bytes_in_a_block_are_rejected(data, key, draw):
    buf = bytearray(encode_block(NAMESPACE, data, key=key))
    positions = draw.draw(st.sets(st.integers(0, len(buf) - 1), min_size=1, max_size=4))
    for i in positions:
        buf[i] ^= draw.draw(st.integers(1, 255))
    for expected in (None, len(data)):
        assert isinstance(verify_outcome(buf, expected=expected, key=key), BlockFormatError)


@PROPERTY
@given(payloads, keys, st.data())
def test_a_truncated_block_is_rejected(data, key, draw):
    buf = encode_block(NAMESPACE, data, key=key)
    cut = draw.draw(st.integers(0, len(buf) - 1))
    assert isinstance(verify_outcome(buf[:cut], key=key), BlockFormatError)
    assert isinstance(verify_outcome(buf[:cut], expected=len(data), key=key), BlockFormatError)


@PROPERTY
@given(payloads, keys, st.binary(min_size=1, max_size=64))
def test_an_extended_block_is_rejected(data, key, tail):
    buf = encode_block(NAMESPACE, data, key=key) + tail
    assert isinstance(verify_outcome(buf, key=key), BlockFormatError)


@PROPERTY
@given(payloads, keys, keys)
def test_a_block_is_accepted_only_with_its_namespace_and_key(data, key, other_key):
    buf = encode_block(NAMESPACE, data, key=key)
    assert verify_outcome(buf, key=key) == data
    assert isinstance(verify_outcome(buf, namespace=OTHER_NAMESPACE, key=key), BlockFormatError)
    if other_key != key:
        assert isinstance(verify_outcome(buf, key=other_key), BlockFormatError)


@PROPERTY
@given(st.binary(max_size=200), st.binary(min_size=16, max_size=16), st.none() | st.integers(0, 300))
def test_arbitrary_bytes_never_crash_verify_or_parse_header(buf, namespace, expected):
    assert isinstance(verify_outcome(buf, namespace, expected), BlockFormatError)
    try:
        parse_header(buf)
    except BlockFormatError:
        pass


@PROPERTY
@given(st.binary(max_size=64), st.data())
def test_a_sealed_header_with_any_fields_is_accepted_only_when_they_all_hold(data, draw):
    """Headers a writer could have sealed (right header checksum) with any
    field values, each either the right one or arbitrary: verify accepts
    only the header that describes ``data``. (``reserved`` is not checked:
    version 1 writes 0 and reads past it.)"""
    right = {"version": FORMAT_VERSION, "header_nbytes": HEADER_NBYTES, "flags": 0, "reserved": 0,
             "payload_nbytes": len(data), "payload_checksum": blockfmt._checksum(data),
             "key_check": blockfmt.key_check(KEY)}
    bits = {"version": 16, "header_nbytes": 16, "flags": 32, "reserved": 32, "payload_nbytes": 64,
            "payload_checksum": 64, "key_check": 64}
    fields = {name: draw.draw(st.just(value) | st.integers(0, 2 ** bits[name] - 1), label=name)
              for name, value in right.items()}
    buf = bytearray(encode_block(NAMESPACE, data, key=KEY))
    rewrite_header(buf, **fields)
    outcome = verify_outcome(buf)
    sound = all(fields[name] == right[name] for name in right if name != "reserved")
    assert outcome == data if sound else isinstance(outcome, BlockFormatError)


def verify_parts_outcome(buf, draw, key=KEY, expected=None):
    """``verify_parts`` on ``buf`` cut into a header and payload parts at
    drawn places: True where accepted, else the BlockFormatError."""
    view = memoryview(bytes(buf))
    header, payload = view[:HEADER_NBYTES], view[HEADER_NBYTES:]
    cuts = sorted(draw.draw(st.lists(st.integers(0, len(payload)), max_size=4)))
    edges = [0] + cuts + [len(payload)]
    parts = [payload[lo:hi] for lo, hi in zip(edges, edges[1:])]
    try:
        verify_parts(header, parts, NAMESPACE, expected, key=key)
        return True
    except BlockFormatError as exc:
        return exc


@PROPERTY
@given(payloads, keys, st.data())
def test_a_block_read_in_parts_is_accepted_whole_and_rejected_changed(data, key, draw):
    """``verify_parts`` (a block read straight into its pages) judges as
    ``verify`` does, however the payload is cut."""
    buf = bytearray(encode_block(NAMESPACE, data, key=key))
    assert verify_parts_outcome(buf, draw, key=key, expected=len(data)) is True
    positions = draw.draw(st.sets(st.integers(0, len(buf) - 1), min_size=1, max_size=4))
    for i in positions:
        buf[i] ^= draw.draw(st.integers(1, 255))
    assert isinstance(verify_parts_outcome(buf, draw, key=key), BlockFormatError)
    assert isinstance(verify_parts_outcome(buf[:-1], draw, key=key), BlockFormatError)
