"""Content addresses: namespaces, model fingerprints and chained block keys."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Sequence

import numpy as np
import pytest

from ucm_connector import hashing
from ucm_connector.hashing import (
    DIGEST_NBYTES,
    KEY_NBYTES,
    BlockHasher,
    MultiModalSpan,
    Namespace,
    keys_for_rank,
    model_fingerprint,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK_SIZE = 16


def make_namespace(**changes) -> Namespace:
    fields = dict(model_fingerprint="0123456789abcdef0123456789abcdef", dtype="bfloat16",
                  kv_layout="CPU_ATTN/vec", block_size=BLOCK_SIZE, num_layers=30,
                  num_kv_heads=3, head_size=64, tp_rank=0, tp_size=1)
    fields.update(changes)
    return Namespace(**fields)


def tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, n).tolist()


@pytest.fixture
def hasher() -> BlockHasher:
    return BlockHasher(make_namespace())


# -- namespace ---------------------------------------------------------------

def test_namespace_digest_is_16_bytes_and_equal_for_equal_fields():
    assert len(make_namespace().digest) == 16
    assert make_namespace().digest == make_namespace().digest


def test_torch_dtype_spelling_names_the_same_namespace():
    assert make_namespace(dtype="torch.bfloat16").digest == make_namespace(dtype="bfloat16").digest


@pytest.mark.parametrize("field,value", [
    ("model_fingerprint", "ffffffffffffffffffffffffffffffff"),
    ("dtype", "float16"),
    ("kv_layout", "CPU_ATTN/amx"),
    ("block_size", 128),
    ("num_layers", 31),
    ("num_kv_heads", 4),
    ("head_size", 128),
    ("tp_rank", 1),
    ("tp_size", 4),
    ("format_version", 2),
    ("extra", (("pp_rank", "1"),)),
])
def test_namespace_digest_changes_with_each_field(field, value):
    base = make_namespace(tp_size=2) if field == "tp_rank" else make_namespace()
    changed = dataclasses.replace(base, **{field: value})
    assert changed.digest != base.digest


def test_namespace_extra_order_does_not_matter():
    a = make_namespace(extra=(("a", "1"), ("b", "2")))
    b = make_namespace(extra=(("b", "2"), ("a", "1")))
    assert a.digest == b.digest
    assert make_namespace(extra={"b": "2", "a": "1"}).digest == a.digest


def test_namespace_string_fields_cannot_collide_by_shifting_characters():
    a = make_namespace(dtype="bfloat16", kv_layout="XCPU")
    b = make_namespace(dtype="bfloat16X", kv_layout="CPU")
    assert a.digest != b.digest


@pytest.mark.parametrize("changes", [
    {"block_size": 0}, {"tp_rank": 2, "tp_size": 2}, {"tp_rank": -1},
    {"dtype": ""}, {"head_size": True}, {"extra": (("a", "1"), ("a", "2"))},
])
def test_namespace_rejects_invalid_fields(changes):
    with pytest.raises(ValueError):
        make_namespace(**changes)


def test_describe_names_the_geometry_in_one_line():
    text = make_namespace().describe()
    assert "\n" not in text
    for part in ("bfloat16", "CPU_ATTN/vec", "block 16", "30 layers", "tp 0/1", "format v1"):
        assert part in text


_DIGEST_SCRIPT = """
import json
from ucm_connector.hashing import BlockHasher, MultiModalSpan, Namespace
ns = Namespace("0123456789abcdef0123456789abcdef", "bfloat16", "CPU_ATTN/vec", 16, 30, 3, 64,
               extra=(("b", "2"), ("a", "1")))
keys = BlockHasher(ns).block_keys(list(range(100)), lora="adapter", cache_salt="salt",
                                  mm_spans=[MultiModalSpan("img", 20, 10)])
print(json.dumps({"ns": ns.digest.hex(), "keys": [k.hex() for k in keys]}))
"""


def test_namespace_digest_and_keys_equal_across_processes_with_different_hash_seeds():
    outputs = []
    for seed in ("0", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=REPO_ROOT)
        run = subprocess.run([sys.executable, "-c", _DIGEST_SCRIPT], env=env, cwd=REPO_ROOT,
                             capture_output=True, text=True, check=True)
        outputs.append(json.loads(run.stdout))
    assert outputs[0] == outputs[1] == outputs[2]
    ns = make_namespace(extra=(("a", "1"), ("b", "2")))
    assert outputs[0]["ns"] == ns.digest.hex()


def test_encoding_is_pinned_by_known_answers():
    # Keys name blocks that outlive the process that wrote them: changing the
    # encoding must come with a KEY_SCHEME_VERSION bump, and changes these.
    ns = make_namespace()
    keys = BlockHasher(ns).block_keys(list(range(32)))
    assert ns.digest.hex() == KNOWN_NAMESPACE_DIGEST
    assert [k.hex() for k in keys] == KNOWN_KEYS


KNOWN_NAMESPACE_DIGEST = "d1f0168630524818d4c4f24fe50178b5"
KNOWN_KEYS = [
    "997443ba3095588a7b62b9a0d67e1d7f0000",
    "ba300e8702932a482b4310c10d9825a40000",
]


# -- model fingerprint -------------------------------------------------------

def write_safetensors(path, tensors: dict[str, np.ndarray]) -> None:
    """A minimal safetensors file: u64 header length, JSON header, data."""
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        data = array.tobytes()
        header[name] = {"dtype": {"float32": "F32", "float16": "F16"}[str(array.dtype)],
                        "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header_bytes = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)) + header_bytes + b"".join(blobs))


def make_model_dir(path, seed: int = 0, rows: int = 64) -> str:
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    write_safetensors(os.path.join(path, "model-00001-of-00002.safetensors"),
                      {"embed.weight": rng.standard_normal((rows, 32), dtype=np.float32)})
    write_safetensors(os.path.join(path, "model-00002-of-00002.safetensors"),
                      {"lm_head.weight": rng.standard_normal((rows, 32), dtype=np.float32)})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"_name_or_path": str(path), "model_type": "llama", "num_hidden_layers": 2,
                   "transformers_version": "4.57.0"}, f)
    return str(path)


def test_same_weights_in_two_directories_give_the_same_fingerprint(tmp_path):
    a = make_model_dir(tmp_path / "a")
    b = str(tmp_path / "elsewhere" / "b")
    shutil.copytree(a, b)
    with open(os.path.join(b, "config.json"), "w") as f:
        # save_pretrained records the save path and tool version; neither changes the KV.
        json.dump({"transformers_version": "4.99.0", "num_hidden_layers": 2,
                   "model_type": "llama", "_name_or_path": b}, f)
    fingerprint = model_fingerprint(a)
    assert len(fingerprint) == 32
    assert model_fingerprint(b) == fingerprint


def test_changed_weight_byte_changes_the_fingerprint(tmp_path):
    path = make_model_dir(tmp_path / "m")
    before = model_fingerprint(path)
    weights = os.path.join(path, "model-00002-of-00002.safetensors")
    with open(weights, "r+b") as f:
        f.seek(os.path.getsize(weights) - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    assert model_fingerprint(path) != before


def test_other_weights_of_the_same_shape_give_another_fingerprint(tmp_path):
    assert model_fingerprint(make_model_dir(tmp_path / "a", seed=0)) != \
        model_fingerprint(make_model_dir(tmp_path / "b", seed=1))


def test_changed_config_changes_the_fingerprint(tmp_path):
    path = make_model_dir(tmp_path / "m")
    before = model_fingerprint(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "num_hidden_layers": 2,
                   "rope_scaling": {"type": "linear", "factor": 2.0}}, f)
    assert model_fingerprint(path) != before


def test_large_files_are_sampled_and_still_tell_weights_apart(tmp_path, monkeypatch):
    # Lower the whole-file limit so the 4 MiB test files take the sampled path.
    monkeypatch.setattr(hashing, "FULL_HASH_MAX_NBYTES", 1 << 20)
    a = make_model_dir(tmp_path / "a", rows=16384)
    b = str(tmp_path / "b")
    shutil.copytree(a, b)
    assert model_fingerprint(a) == model_fingerprint(b)
    weights = os.path.join(b, "model-00001-of-00002.safetensors")
    with open(weights, "r+b") as f:
        f.seek(200)  # inside the first MiB of tensor data
        f.write(b"\xff\xff\xff\xff")
    assert model_fingerprint(a) != model_fingerprint(b)


def test_sampling_reads_each_safetensors_header_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(hashing, "FULL_HASH_MAX_NBYTES", 1 << 20)
    a = make_model_dir(tmp_path / "a", rows=16384)
    b = make_model_dir(tmp_path / "b", rows=16384)
    weights = os.path.join(b, "model-00001-of-00002.safetensors")
    with open(weights, "rb") as f:
        data = bytearray(f.read())
    # Same bytes everywhere except the tensor's name in the JSON header.
    index = data.index(b"embed.weight")
    data[index:index + 5] = b"EMBED"
    with open(weights, "wb") as f:
        f.write(data)
    assert model_fingerprint(a) != model_fingerprint(b)


def test_a_single_gguf_file_can_be_fingerprinted(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 10)
    assert model_fingerprint(path) == model_fingerprint(path)
    assert len(model_fingerprint(path)) == 32


def test_fingerprint_of_a_directory_without_weights_says_so(tmp_path):
    with pytest.raises(ValueError, match="no weight files"):
        model_fingerprint(tmp_path)
    with pytest.raises(FileNotFoundError):
        model_fingerprint(tmp_path / "missing")


# -- block keys --------------------------------------------------------------

def test_keys_are_one_per_full_block_and_a_partial_block_has_none(hasher):
    keys = hasher.block_keys(tokens(5 * BLOCK_SIZE + 7))
    assert len(keys) == 5
    assert all(len(k) == KEY_NBYTES for k in keys)
    assert len(set(keys)) == 5
    assert hasher.block_keys(tokens(BLOCK_SIZE - 1)) == []


def test_partial_block_tokens_do_not_affect_keys(hasher):
    ids = tokens(3 * BLOCK_SIZE + 5)
    other_tail = ids[:3 * BLOCK_SIZE] + [7, 7, 7, 7, 7]
    assert hasher.block_keys(ids) == hasher.block_keys(other_tail)


def test_changing_a_token_in_block_0_changes_every_key(hasher):
    ids = tokens(6 * BLOCK_SIZE)
    changed = list(ids)
    changed[3] += 1
    before, after = hasher.block_keys(ids), hasher.block_keys(changed)
    assert all(b != a for b, a in zip(before, after))


def test_changing_block_2_keeps_blocks_0_and_1_and_changes_the_rest(hasher):
    ids = tokens(6 * BLOCK_SIZE)
    changed = list(ids)
    changed[2 * BLOCK_SIZE + 5] += 1
    before, after = hasher.block_keys(ids), hasher.block_keys(changed)
    assert before[:2] == after[:2]
    assert all(b != a for b, a in zip(before[2:], after[2:]))


def test_same_block_tokens_at_another_position_get_another_key(hasher):
    block = tokens(BLOCK_SIZE)
    keys = hasher.block_keys(block * 3)
    assert len(set(keys)) == 3


def test_token_ids_are_hashed_as_32_bit_values(hasher):
    # 256 and [0, 1] would collide under a byte-per-token encoding.
    a = [256] + [0] * (BLOCK_SIZE - 1)
    b = [0, 1] + [0] * (BLOCK_SIZE - 2)
    assert hasher.block_keys(a) != hasher.block_keys(b)
    with pytest.raises(ValueError):
        hasher.block_keys([2 ** 32] * BLOCK_SIZE)
    with pytest.raises(ValueError):
        hasher.block_keys([-1] * BLOCK_SIZE)


def test_numpy_tokens_give_the_same_keys_as_a_list(hasher):
    ids = tokens(4 * BLOCK_SIZE + 3)
    assert hasher.block_keys(np.array(ids, dtype=np.int64)) == hasher.block_keys(ids)
    assert hasher.block_keys(np.array(ids, dtype=np.uint32)) == hasher.block_keys(ids)


class ReadOnlyTokens(Sequence):
    """Stands in for vLLM's ConstantList: a Sequence wrapper around a list."""

    def __init__(self, items):
        self._items = items

    def __getitem__(self, index):
        return self._items[index]

    def __len__(self):
        return len(self._items)


def test_a_sequence_wrapper_gives_the_same_keys_as_its_list(hasher):
    ids = tokens(4 * BLOCK_SIZE + 3)
    assert hasher.block_keys(ReadOnlyTokens(ids)) == hasher.block_keys(ids)
    request = hasher.request()
    request.update(ReadOnlyTokens(ids[:2 * BLOCK_SIZE]))
    assert request.update(ReadOnlyTokens(ids)) == hasher.block_keys(ids)


def test_other_namespace_never_shares_a_key():
    ids = tokens(4 * BLOCK_SIZE)
    keys_a = BlockHasher(make_namespace()).block_keys(ids)
    keys_b = BlockHasher(make_namespace(dtype="float16")).block_keys(ids)
    keys_c = BlockHasher(make_namespace(model_fingerprint="f" * 32)).block_keys(ids)
    assert not set(keys_a) & set(keys_b)
    assert not set(keys_a) & set(keys_c)


def test_tp_ranks_share_the_chain_but_not_the_keys():
    ids = tokens(4 * BLOCK_SIZE)
    rank0 = BlockHasher(make_namespace(tp_rank=0, tp_size=2)).block_keys(ids)
    rank1 = BlockHasher(make_namespace(tp_rank=1, tp_size=2)).block_keys(ids)
    assert not set(rank0) & set(rank1)
    assert [k[:DIGEST_NBYTES] for k in rank0] == [k[:DIGEST_NBYTES] for k in rank1]
    assert keys_for_rank(rank0, 1) == rank1
    assert make_namespace(tp_rank=0, tp_size=2).for_rank(1) == make_namespace(tp_rank=1, tp_size=2)


def test_each_generation_of_keys_shares_no_key_with_another(hasher):
    """After vLLM resets the connector's cache (the weights may have
    changed) the engine keys blocks in a new, random generation: no key of
    it equals one of the first generation's (which stays as pinned above)
    or of any other generation's."""
    ids = tokens(4 * BLOCK_SIZE)
    first = hasher.block_keys(ids)
    second = hasher.next_generation()
    third = second.next_generation()
    assert BlockHasher(hasher.namespace, b"").block_keys(ids) == first
    assert len(second.generation) == DIGEST_NBYTES and second.generation != third.generation
    assert second.namespace == hasher.namespace
    keys = [first, second.block_keys(ids), third.block_keys(ids), second.block_keys(ids, cache_salt="a")]
    assert len(set().union(*keys)) == sum(len(k) for k in keys)
    assert BlockHasher(hasher.namespace, second.generation).block_keys(ids) == keys[1]
    assert second.request().update(ids) == keys[1]
    with pytest.raises(ValueError, match="generation is 16 bytes, got 5"):
        BlockHasher(hasher.namespace, b"short")


@pytest.mark.parametrize("extras", [
    {"cache_salt": "tenant-a"},
    {"lora": "sql-adapter"},
    {"mm_spans": [MultiModalSpan("image-hash-1", 0, 8)]},
])
def test_each_extra_changes_the_keys(hasher, extras):
    ids = tokens(4 * BLOCK_SIZE)
    assert not set(hasher.block_keys(ids)) & set(hasher.block_keys(ids, **extras))


def test_cache_salt_and_lora_values_are_told_apart(hasher):
    ids = tokens(2 * BLOCK_SIZE)
    variants = [{}, {"cache_salt": "a"}, {"cache_salt": "b"}, {"cache_salt": ""},
                {"lora": "a"}, {"lora": "a", "cache_salt": "a"}, {"lora": "b"}]
    first_keys = [hasher.block_keys(ids, **v)[0] for v in variants]
    assert len(set(first_keys)) == len(variants)


def test_multimodal_span_changes_only_the_blocks_it_overlaps_and_later(hasher):
    ids = tokens(6 * BLOCK_SIZE)
    plain = hasher.block_keys(ids)
    with_image = hasher.block_keys(ids, mm_spans=[("img", 2 * BLOCK_SIZE + 4, 20)])
    assert with_image[:2] == plain[:2]
    assert all(a != b for a, b in zip(with_image[2:], plain[2:]))


def test_different_images_on_the_same_placeholder_tokens_get_different_keys(hasher):
    ids = tokens(4 * BLOCK_SIZE)
    a = hasher.block_keys(ids, mm_spans=[MultiModalSpan("cat", 16, 32)])
    b = hasher.block_keys(ids, mm_spans=[MultiModalSpan("dog", 16, 32)])
    assert a[0] == b[0]
    assert a[1] != b[1] and a[2] != b[2] and a[3] != b[3]


def test_same_image_at_another_place_in_the_block_gets_another_key(hasher):
    ids = tokens(2 * BLOCK_SIZE)
    a = hasher.block_keys(ids, mm_spans=[MultiModalSpan("img", 2, 8)])
    b = hasher.block_keys(ids, mm_spans=[MultiModalSpan("img", 3, 8)])
    assert a[0] != b[0]


def test_multimodal_span_order_of_arguments_does_not_matter(hasher):
    ids = tokens(4 * BLOCK_SIZE)
    spans = [MultiModalSpan("a", 3, 5), MultiModalSpan("b", 9, 30)]
    assert hasher.block_keys(ids, mm_spans=spans) == hasher.block_keys(ids, mm_spans=spans[::-1])


# -- per-request incremental keys ---------------------------------------------

class CountingDigest:
    def __init__(self, monkeypatch):
        self.calls = 0
        real = hashing._xxh3_128

        def counting(data):
            self.calls += 1
            return real(data)
        monkeypatch.setattr(hashing, "_xxh3_128", counting)


def test_incremental_updates_equal_one_shot_hashing(hasher):
    ids = tokens(20 * BLOCK_SIZE + 9)
    spans = [MultiModalSpan("img", 5 * BLOCK_SIZE + 3, 40)]
    expected = hasher.block_keys(ids, lora="l", cache_salt="s", mm_spans=spans)
    request = hasher.request(lora="l", cache_salt="s", mm_spans=spans)
    for end in (0, 7, BLOCK_SIZE, 3 * BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 2, 11 * BLOCK_SIZE,
                len(ids)):
        assert request.update(ids[:end]) == expected[:end // BLOCK_SIZE]
    assert request.keys == expected
    assert request.num_blocks == 20 and request.num_tokens == 20 * BLOCK_SIZE


def test_each_block_of_a_request_is_hashed_once(hasher, monkeypatch):
    counter = CountingDigest(monkeypatch)
    request = hasher.request()
    ids = tokens(10 * BLOCK_SIZE + 3)
    counter.calls = 0  # the root was hashed when the request was created
    request.update(ids)
    assert counter.calls == 10
    for _ in range(5):
        request.update(ids)  # the scheduler asking again
    assert counter.calls == 10
    ids = ids + tokens(2 * BLOCK_SIZE, seed=1)  # decode made two more blocks full
    request.update(ids)
    assert counter.calls == 12


def test_decode_one_token_at_a_time_hashes_each_block_once(hasher, monkeypatch):
    counter = CountingDigest(monkeypatch)
    ids = tokens(BLOCK_SIZE + 5)
    request = hasher.request()
    counter.calls = 0
    for token in tokens(3 * BLOCK_SIZE, seed=2):
        keys = request.update(ids)
        ids.append(token)
    keys = request.update(ids)
    assert len(keys) == len(ids) // BLOCK_SIZE
    assert counter.calls == len(keys)
    assert keys == hasher.block_keys(ids)


def test_update_with_another_requests_tokens_raises(hasher):
    request = hasher.request()
    request.update(tokens(3 * BLOCK_SIZE))
    with pytest.raises(ValueError, match="do not extend"):
        request.update(tokens(4 * BLOCK_SIZE, seed=9))


def test_returned_keys_are_a_copy(hasher):
    request = hasher.request()
    keys = request.update(tokens(2 * BLOCK_SIZE))
    keys.clear()
    assert len(request.update(tokens(2 * BLOCK_SIZE))) == 2


def test_hashing_and_blockfmt_import_without_vllm_or_torch():
    code = ("import sys; import ucm_connector.hashing, ucm_connector.blockfmt; "
            "bad = [m for m in ('vllm', 'torch') if m in sys.modules]; print(bad)")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True, env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    assert run.stdout.strip() == "[]"


def _config_dir(path, **config) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"hidden_size": 64, "_name_or_path": str(path), **config}, f)
    return str(path)


def test_weights_streamed_from_an_object_store_are_known_by_url_and_config(tmp_path):
    """With --load-format runai_streamer and an s3:// model, vLLM pulls the
    config files into a local directory (its ``model``) and keeps the URL
    in ``model_weights``; the directory has no weight files."""
    from ucm_connector.hashing import model_identity

    a = _config_dir(tmp_path / "pulled-a")
    b = _config_dir(tmp_path / "pulled-b")                 # the same files pulled elsewhere
    url = "s3://models/llama-8b"
    ident = model_identity(a, None, url)
    assert ident == model_identity(b, None, url)
    assert ident != model_identity(a, None, "s3://models/llama-8b-v2")
    assert ident != model_identity(_config_dir(tmp_path / "c", hidden_size=128), None, url)
    with open(os.path.join(a, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 1}, "weight_map": {"w": "model-00001.safetensors"}}, f)
    assert model_identity(a, None, url) != ident            # another weight index
    assert model_identity(a, None, url) != model_identity(a)  # not the weightless directory's own


def test_a_directory_without_weights_is_known_by_its_config(tmp_path):
    """--load-format dummy on a config-only directory: the weights depend on
    the config alone (the namespace also names the load format)."""
    from ucm_connector.hashing import model_identity

    a = _config_dir(tmp_path / "a")
    assert model_identity(a) == model_identity(_config_dir(tmp_path / "b"))
    assert model_identity(a) != model_identity(_config_dir(tmp_path / "c", hidden_size=128))
    assert model_identity(a).startswith("config:")


def test_a_tensorizer_file_is_a_weight_file(tmp_path):
    d = _config_dir(tmp_path / "t")
    with open(os.path.join(d, "model.tensors"), "wb") as f:
        f.write(b"\1" * 1000)
    first = model_fingerprint(d)
    with open(os.path.join(d, "model.tensors"), "wb") as f:
        f.write(b"\2" * 1000)
    assert model_fingerprint(d) != first
