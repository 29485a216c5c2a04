"""The namespace manifest reader: any stored bytes become either a sound
``Manifest`` or a ``ManifestError`` that says why, never another exception,
and only the canonical encoding of a valid manifest, stored under its own
digest, is accepted.

The property tests throw arbitrary bytes, arbitrary JSON and damaged copies
of a real manifest at ``parse_manifest``; the examples pin the cases seen in
the field (an integer of 2**63 or more, an unknown field)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from ucm_connector.hashing import Namespace
from ucm_connector.manifest import (
    MAX_MANIFEST_NBYTES,
    Manifest,
    ManifestError,
    NewerManifestError,
    encode_manifest,
    parse_manifest,
)

NS = Namespace(model_fingerprint="f" * 32, dtype="bfloat16", kv_layout="cpu/CPU_ATTN/vec/auto",
               block_size=16, num_layers=2, num_kv_heads=2, head_size=8, tp_rank=1, tp_size=2,
               extra=(("lora", "abc"),))
GOOD = encode_manifest(NS, model_name="models/tiny", created=1735689600.5)
FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def record() -> dict:
    return json.loads(GOOD)


def encoded(rec: dict) -> bytes:
    """``rec`` written the way encode_manifest writes (canonical JSON)."""
    return json.dumps(rec, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def parse_or_error(value: bytes, digest: bytes | None = NS.digest) -> Manifest | ManifestError:
    """What the reader makes of ``value``: only the two allowed outcomes
    get through, anything else fails the test."""
    try:
        return parse_manifest(value, digest)
    except ManifestError as exc:
        return exc


# -- examples --------------------------------------------------------------------------------

def test_a_manifest_round_trips_to_its_namespace_and_model():
    manifest = parse_manifest(GOOD, NS.digest)
    assert manifest.namespace == NS and manifest.digest == NS.digest
    assert manifest.model_name == "models/tiny" and manifest.created == 1735689600.5
    assert encoded(manifest.to_dict()) == GOOD


def test_a_manifest_without_a_model_name_round_trips():
    value = encode_manifest(NS, model_name=None, created=1.0)
    assert parse_manifest(value, NS.digest).model_name is None


@pytest.mark.parametrize("field", ["block_size", "num_layers", "head_size", "tp_size", "format_version"])
def test_an_integer_of_2_to_the_63_or_more_is_a_bad_manifest(field):
    rec = record()
    rec["namespace"][field] = 2 ** 63
    with pytest.raises(ManifestError, match=field):
        parse_manifest(encoded(rec), NS.digest)


def test_an_unknown_namespace_field_is_a_bad_manifest():
    rec = record()
    rec["namespace"]["pipeline_stage"] = 1
    with pytest.raises(ManifestError, match="pipeline_stage"):
        parse_manifest(encoded(rec), NS.digest)


def test_an_unknown_top_level_field_is_a_bad_manifest():
    rec = record()
    rec["note"] = "hello"
    with pytest.raises(ManifestError, match="note"):
        parse_manifest(encoded(rec), NS.digest)


@pytest.mark.parametrize("field", ["model_fingerprint", "tp_rank", "extra"])
def test_a_missing_namespace_field_is_a_bad_manifest(field):
    rec = record()
    del rec["namespace"][field]
    with pytest.raises(ManifestError, match=field):
        parse_manifest(encoded(rec), NS.digest)


@pytest.mark.parametrize("field, value", [
    ("block_size", True), ("block_size", 16.0), ("block_size", "16"), ("dtype", 5),
    ("extra", [["lora"]]), ("extra", {"lora": "abc"}), ("extra", [["lora", 1]]), ("tp_rank", 2),
])
def test_a_namespace_field_of_the_wrong_type_or_value_is_a_bad_manifest(field, value):
    rec = record()
    rec["namespace"][field] = value
    with pytest.raises(ManifestError):
        parse_manifest(encoded(rec), NS.digest)


@pytest.mark.parametrize("field, value", [
    ("created", None), ("created", True), ("created", 1735689600), ("model_name", 3),
    ("writer", "me"), ("writer", {"host": "h"}), ("digest", NS.digest.hex().upper()), ("kind", "other"),
])
def test_a_top_level_field_of_the_wrong_type_or_value_is_a_bad_manifest(field, value):
    rec = record()
    rec[field] = value
    with pytest.raises(ManifestError):
        parse_manifest(encoded(rec), NS.digest)


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_a_creation_time_that_is_not_a_finite_number_is_a_bad_manifest(text):
    value = GOOD.replace(b'"created":1735689600.5', b'"created":' + text.encode())
    assert value != GOOD
    with pytest.raises(ManifestError):
        parse_manifest(value, NS.digest)


def test_a_manifest_not_in_canonical_form_is_a_bad_manifest():
    spaced = json.dumps(record(), sort_keys=True).encode()
    with pytest.raises(ManifestError, match="canonical"):
        parse_manifest(spaced, NS.digest)
    repeated = GOOD[:-1] + b',"model_name":"models/other"}'
    with pytest.raises(ManifestError):
        parse_manifest(repeated, NS.digest)


def test_a_manifest_stored_under_another_digest_is_a_bad_manifest():
    with pytest.raises(ManifestError, match="describes namespace"):
        parse_manifest(GOOD, NS.for_rank(0).digest)


def test_a_newer_manifest_version_is_not_damage_and_says_upgrade():
    rec = record()
    rec["manifest_version"] = 2
    rec["namespace"]["pipeline_stage"] = 1
    with pytest.raises(NewerManifestError, match="upgrade"):
        parse_manifest(encoded(rec), NS.digest)


@pytest.mark.parametrize("value", [
    b"[" * 50_000,                                  # deeper than the JSON parser recurses
    b'{"a":' * 20_000 + b"1" + b"}" * 20_000,
    b'{"created":' + b"9" * 5000 + b"}",              # more digits than int() takes
    b"",
    b"\xff\xfe",
    b"null",
    b'"ucm-namespace-manifest"',
    b"x" * (MAX_MANIFEST_NBYTES + 1),
])
def test_pathological_values_are_bad_manifests(value):
    with pytest.raises(ManifestError):
        parse_manifest(value, NS.digest)


# -- properties ------------------------------------------------------------------------------

@FAST
@given(st.binary(max_size=2048))
def test_any_bytes_are_a_manifest_or_a_manifest_error(value):
    outcome = parse_or_error(value, None)
    if isinstance(outcome, Manifest):
        assert encoded(outcome.to_dict()) == value


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12)
top_fields = st.sampled_from(sorted(record()) + ["other"])
namespace_fields = st.sampled_from(sorted(record()["namespace"]) + ["other"])


@FAST
@given(st.lists(st.tuples(st.booleans(), st.one_of(top_fields, namespace_fields), json_values,
                          st.booleans()), min_size=1, max_size=4))
def test_any_edit_of_a_manifests_fields_is_rejected_unless_it_is_a_valid_manifest(edits):
    rec = record()
    for in_namespace, field, value, remove in edits:
        target = rec["namespace"] if in_namespace and isinstance(rec.get("namespace"), dict) else rec
        if remove:
            target.pop(field, None)
        else:
            target[field] = value
    try:
        value = json.dumps(rec, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    except (TypeError, ValueError):
        return
    outcome = parse_or_error(value)
    if isinstance(outcome, Manifest):
        # Only fields outside the namespace can change and stay valid.
        assert outcome.namespace == NS
        assert encoded(outcome.to_dict()) == value


def _span(field: bytes, end: bytes) -> range:
    start = GOOD.index(b'"%s":' % field)
    return range(start, GOOD.index(end, start) + len(end))


# Where the namespace and its digest are written (the model name and the
# creation time are free text): any change there must be refused.
_CHECKED = [*_span(b"digest", b'",'), *_span(b"namespace", b"},")]


@FAST
@given(st.sampled_from(_CHECKED), st.integers(0, 255))
def test_a_changed_byte_in_the_namespace_or_digest_is_always_rejected(offset, byte):
    assume(GOOD[offset] != byte)
    damaged = bytearray(GOOD)
    damaged[offset] = byte
    outcome = parse_or_error(bytes(damaged))
    assert isinstance(outcome, ManifestError)


@FAST
@given(st.integers(0, len(GOOD) - 1), st.binary(min_size=1, max_size=8))
def test_a_truncated_or_extended_manifest_is_rejected(cut, tail):
    assert isinstance(parse_or_error(GOOD[:cut]), ManifestError)
    assert isinstance(parse_or_error(GOOD + tail), ManifestError)
