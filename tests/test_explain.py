"""``ucm explain`` against real stores filled the way engines fill them.

Blocks are real envelopes under the keys the connector computes (hashing),
each namespace with its manifest, for the real tiny-llama model directory
(its fingerprint and tokenizer), in 16-token blocks so that prompts span
many blocks. Each test asks about one prompt and checks what an operator or
a router reads: the hit, the first missing block and the reason.
tests/test_explain_e2e.py checks the same against a real engine's hits.
"""

from __future__ import annotations

import functools
import json
import os
import sysconfig
import uuid

import numpy as np
import pytest

from explain_helper import explain
from store_backends import OpenMode, open_store
from ucm_connector import blockfmt
from ucm_connector.adapters import AdapterIdentities, lora_settings
from ucm_connector.hashing import BlockHasher, Namespace, keys_for_rank, model_fingerprint
from ucm_connector.manifest import encode_manifest, manifest_key

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "models", "tiny-llama")
BS = 16

pytestmark = pytest.mark.skipif(not os.path.isdir(TINY), reason=f"{TINY} missing: run `make models`")


@functools.lru_cache(maxsize=1)
def tiny_fingerprint() -> str:
    return model_fingerprint(TINY)


@functools.lru_cache(maxsize=1)
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY)


def source_text(relpath: str, nchars: int = 2000) -> str:
    with open(os.path.join(sysconfig.get_paths()["stdlib"], relpath), encoding="utf-8") as f:
        return f.read()[:nchars]


TEXT = source_text("json/decoder.py")
OTHER_TEXT = source_text("csv.py")


def tokens(text: str) -> list[int]:
    return tokenizer().encode(text, add_special_tokens=True)


def ns(**changes) -> Namespace:
    fields = dict(model_fingerprint=tiny_fingerprint(), dtype="bfloat16", kv_layout="cpu/CPU_ATTN/vec/auto",
                  block_size=BS, num_layers=4, num_kv_heads=2, head_size=64, tp_rank=0, tp_size=1)
    fields.update(changes)
    return Namespace(**fields)


def save(url: str, namespace: Namespace, token_ids, *, cache_salt=None, lora=None, ranks=None,
         manifest=True) -> list[bytes]:
    """Store the prompt's full blocks as a saving engine would: every rank's
    shard and manifest. Returns rank 0's keys."""
    keys = BlockHasher(namespace.for_rank(0)).block_keys(token_ids, lora=lora, cache_salt=cache_salt)
    with open_store(url) as store:
        for rank in range(namespace.tp_size) if ranks is None else ranks:
            rank_ns = namespace.for_rank(rank)
            rank_keys = keys_for_rank(keys, rank)
            payload = np.full(64, rank, np.uint8)
            values = [blockfmt.encode_block(rank_ns.digest, payload, key=k) for k in rank_keys]
            assert store.put(rank_keys, values) == [True] * len(keys)
            if manifest:
                assert store.put([manifest_key(rank_ns.digest)], [encode_manifest(rank_ns, TINY)]) == [True]
    return keys


def delete(url: str, keys) -> None:
    with open_store(url) as store:
        store.delete(list(keys))


def ask(url: str, *args: str, prompt: str = TEXT):
    return explain("--store", url, "--model", TINY, "--prompt", prompt, "--json", *args)


@pytest.fixture
def disk(tmp_path) -> str:
    url = f"disk://{tmp_path}/store"
    open_store(url).close()
    return url


# -- hits and misses ------------------------------------------------------------------

def test_a_stored_prompt_hits_every_block_but_the_one_holding_its_last_token(disk):
    ids = tokens(TEXT)
    ids = ids[:len(ids) // BS * BS]            # block-aligned: its last full block is computed
    save(disk, ns(), ids)
    result = explain("--store", disk, "--model", TINY, "--token-ids", "-", "--json", stdin=json.dumps(ids))
    report = result.report
    assert result.rc == 0, result.stderr
    num_blocks = len(ids) // BS
    assert report["reason"] == "full_hit"
    assert report["stored_prefix_blocks"] == num_blocks - 1
    assert report["hit_tokens"] == (num_blocks - 1) * BS
    assert report["first_miss"] is None
    assert len(report["blocks"]) == num_blocks
    assert all(b["stored"] for b in report["blocks"])
    assert [b["loadable"] for b in report["blocks"]] == [True] * (num_blocks - 1) + [False]


def test_the_text_prompt_is_tokenised_like_vllm_does_a_completion(disk):
    ids = tokens(TEXT)
    save(disk, ns(), ids)
    by_text = ask(disk).report
    by_ids = explain("--store", disk, "--model", TINY, "--token-ids", "-", "--json",
                     stdin=" ".join(map(str, ids))).report
    assert by_text["num_tokens"] == len(ids)
    assert by_text["stored_prefix_blocks"] == by_ids["stored_prefix_blocks"] == (len(ids) - 1) // BS
    assert by_text["reason"] == "full_hit"


def test_chat_applies_the_models_chat_template(disk):
    rendered = tokenizer().apply_chat_template([{"role": "user", "content": TEXT}], tokenize=False,
                                               add_generation_prompt=True)
    chat_ids = tokenizer().encode(rendered, add_special_tokens=False)
    save(disk, ns(), chat_ids)
    as_chat = ask(disk, "--chat").report
    assert as_chat["num_tokens"] == len(chat_ids)
    assert as_chat["reason"] == "full_hit"
    assert as_chat["stored_prefix_blocks"] == (len(chat_ids) - 1) // BS
    # The same text as a completion prompt starts differently: nothing hits.
    assert ask(disk).report["stored_prefix_blocks"] == 0


def test_a_prompt_that_diverges_names_the_first_block_that_differs(disk):
    stored = tokens(TEXT)
    save(disk, ns(), stored)
    asked = stored[:5 * BS + 3] + tokens(OTHER_TEXT)[:200]
    result = explain("--store", disk, "--model", TINY, "--token-ids", "-", "--json", stdin=json.dumps(asked))
    report = result.report
    assert result.rc == 1
    assert report["stored_prefix_blocks"] == 5
    assert report["hit_tokens"] == 5 * BS
    assert report["first_miss"] == {"index": 5, "start": 5 * BS, "end": 6 * BS}
    assert report["reason"] == "diverges"
    assert "diverges at block 5 (tokens 80-95)" in report["message"]


def test_a_prompt_of_which_nothing_is_stored_diverges_at_block_0(disk):
    save(disk, ns(), tokens(TEXT))
    report = ask(disk, prompt=OTHER_TEXT).report
    assert report["stored_prefix_blocks"] == 0
    assert report["first_miss"]["index"] == 0
    assert report["reason"] == "diverges"
    assert "--cache-salt" in report["message"]


def test_a_missing_block_before_stored_ones_is_reported_evicted(disk):
    keys = save(disk, ns(), tokens(TEXT))
    delete(disk, [keys[7]])
    result = ask(disk)
    assert result.rc == 1
    report = result.report
    assert report["stored_prefix_blocks"] == 7
    assert report["first_miss"] == {"index": 7, "start": 7 * BS, "end": 8 * BS}
    assert report["reason"] == "evicted"
    assert [b["index"] for b in report["blocks"] if not b["stored"]] == [7]


def test_a_prompt_shorter_than_a_block_has_nothing_to_load(disk):
    save(disk, ns(), tokens(TEXT))
    result = ask(disk, prompt="def f(x):")
    assert result.rc == 0
    assert result.report["reason"] == "too_short"
    assert result.report["stored_prefix_blocks"] == 0


def test_a_hit_below_min_hit_blocks_loads_nothing(disk):
    keys = save(disk, ns(), tokens(TEXT))
    delete(disk, [keys[2]])
    report = ask(disk, "--min-hit-blocks", "3").report
    assert report["stored_prefix_blocks"] == 0
    assert report["first_miss"]["index"] == 2
    assert report["reason"] == "evicted"
    assert "--min-hit-blocks 3" in report["message"]
    assert ask(disk, "--min-hit-blocks", "2").report["stored_prefix_blocks"] == 2


# -- namespaces --------------------------------------------------------------------------

def test_blocks_under_another_dtype_name_the_dtype(disk):
    save(disk, ns(), tokens(TEXT))
    save(disk, ns(dtype="float32"), tokens(OTHER_TEXT))     # the float32 engine saved something else
    result = ask(disk, "--dtype", "float32")
    report = result.report
    assert result.rc == 1
    assert report["namespace"]["namespace"]["dtype"] == "float32"
    assert report["stored_prefix_blocks"] == 0
    assert report["reason"] == "other_namespace"
    other = report["other_namespaces"][0]
    assert other["namespace"]["dtype"] == "bfloat16"
    assert other["stored_prefix_blocks"] == (report["num_tokens"] - 1) // BS
    assert other["differences"] == [{"field": "dtype", "label": "dtype", "this": "float32", "other": "bfloat16"}]
    assert "dtype bfloat16 (this engine: float32)" in report["message"]


def test_a_dtype_no_engine_saved_in_is_named_too(disk):
    save(disk, ns(), tokens(TEXT))
    report = ask(disk, "--dtype", "fp32").report
    assert report["namespace"] is None
    assert report["stored_prefix_blocks"] == 0
    assert report["first_miss"] == {"index": 0, "start": 0, "end": BS}
    assert report["reason"] == "other_namespace"
    assert report["other_namespaces"][0]["differences"][0]["field"] == "dtype"


def test_blocks_under_another_block_size_name_the_block_size(disk):
    save(disk, ns(), tokens(TEXT))
    save(disk, ns(block_size=32), tokens(OTHER_TEXT))
    report = ask(disk, "--block-size", "32").report
    assert report["block_size"] == 32
    assert report["blocks"][1] == {"index": 1, "start": 32, "end": 64, "stored": False, "loadable": True,
                                   "missing_ranks": [0]}
    assert report["reason"] == "other_namespace"
    assert [d["field"] for d in report["other_namespaces"][0]["differences"]] == ["block_size"]


def test_without_a_selection_the_namespace_holding_most_is_explained_and_the_others_listed(disk):
    save(disk, ns(dtype="float32"), tokens(OTHER_TEXT))
    save(disk, ns(), tokens(TEXT))
    report = ask(disk).report
    assert report["reason"] == "full_hit"
    assert report["namespace"]["namespace"]["dtype"] == "bfloat16"
    assert [o["namespace"]["dtype"] for o in report["other_namespaces"]] == ["float32"]
    assert any("2 namespaces of this model match" in n for n in report["notes"])
    chosen = ask(disk, "--namespace", ns(dtype="float32").digest.hex()[:8]).report
    assert chosen["namespace"]["namespace"]["dtype"] == "float32"
    assert chosen["reason"] == "other_namespace"


def test_a_missing_tp_shard_names_the_rank(disk):
    keys = save(disk, ns(tp_size=2), tokens(TEXT))
    delete(disk, keys_for_rank([keys[3]], 1))
    report = ask(disk).report
    assert report["stored_prefix_blocks"] == 3
    assert report["first_miss"]["index"] == 3
    assert report["blocks"][3]["missing_ranks"] == [1]
    assert report["reason"] == "tp_shard_missing"
    assert len(report["namespace"]["rank_digests"]) == 2


def test_blocks_of_another_tp_size_name_the_tp_size(disk):
    save(disk, ns(tp_size=2), tokens(TEXT))
    report = ask(disk, "--tp-size", "1").report
    assert report["reason"] == "other_namespace"
    assert [d["field"] for d in report["other_namespaces"][0]["differences"]] == ["tp_size"]


def test_a_store_with_nothing_for_this_model_says_so(disk):
    save(disk, ns(model_fingerprint="0" * 32), tokens(OTHER_TEXT))
    result = ask(disk)
    assert result.rc == 1
    report = result.report
    assert report["reason"] == "no_model"
    assert report["stored_prefix_blocks"] == 0
    assert report["namespace"] is None
    assert "holds nothing for this model" in report["message"]


def test_an_empty_store_holds_nothing_for_this_model(disk):
    report = ask(disk).report
    assert report["reason"] == "no_model"
    assert report["other_namespaces"] == []


def test_the_same_prompt_under_other_weights_names_the_model_weights(disk):
    save(disk, ns(model_fingerprint="0" * 32), tokens(TEXT))
    report = ask(disk).report
    assert report["reason"] == "other_model"
    assert report["other_namespaces"][0]["same_model"] is False
    assert report["other_namespaces"][0]["differences"][0]["field"] == "model_fingerprint"


def test_a_prompt_stored_without_the_given_cache_salt_says_so_without_printing_the_salt(disk):
    save(disk, ns(), tokens(TEXT))
    secret = "tenant-" + uuid.uuid4().hex
    result = explain("--store", disk, "--model", TINY, "--prompt", TEXT, "--cache-salt", secret)
    assert result.rc == 1
    assert "reason: cache_salt:" in result.stdout
    assert secret not in result.stdout + result.stderr
    report = ask(disk, "--cache-salt", secret).report
    assert report["stored_prefix_blocks"] == 0
    assert report["reason"] == "cache_salt"
    assert report["alternatives"][0]["stored_prefix_blocks"] == (report["num_tokens"] - 1) // BS
    assert secret not in json.dumps(report)


def test_a_prompt_stored_with_its_cache_salt_hits(disk):
    save(disk, ns(), tokens(TEXT), cache_salt="tenant-7")
    assert ask(disk).report["stored_prefix_blocks"] == 0
    report = ask(disk, "--cache-salt", "tenant-7").report
    assert report["reason"] == "full_hit"


def test_lora_requests_are_looked_up_under_the_adapters_identity(disk, tmp_path):
    from test_lora_e2e import write_tiny_llama_adapter

    adapter = write_tiny_llama_adapter(tmp_path / "adapter", seed=1)
    identity = AdapterIdentities(lora_settings(dtype="bfloat16")).identity(1, adapter, "ad")
    save(disk, ns(), tokens(TEXT), lora=identity)
    assert ask(disk, "--lora", adapter).report["reason"] == "full_hit"
    assert ask(disk).report["stored_prefix_blocks"] == 0

    base_only = f"disk://{tmp_path}/base-only"
    save(base_only, ns(), tokens(TEXT))
    report = ask(base_only, "--lora", adapter).report
    assert report["reason"] == "lora"
    assert report["stored_prefix_blocks"] == 0
    assert report["alternatives"][0]["with_lora"] is False


# -- the text report ----------------------------------------------------------------------

def test_the_text_report_shows_blocks_hit_first_miss_and_reason(disk):
    keys = save(disk, ns(), tokens(TEXT))
    delete(disk, [keys[4]])
    result = explain("--store", disk, "--model", TINY, "--prompt", TEXT)
    assert result.rc == 1
    lines = result.stdout.splitlines()
    assert lines[0] == f"store {disk} (read-only)"
    assert any(line.split()[:3] == ["0-3", "0-63", "yes"] for line in lines)
    assert any(line.split()[:3] == ["4", "64-79", "no"] and "first miss" in line for line in lines)
    assert "a request would load 4 blocks (64 of" in result.stdout
    assert "first miss: block 4 (tokens 64-79)" in result.stdout
    assert "reason: evicted:" in result.stdout


# -- stores ---------------------------------------------------------------------------------

@pytest.fixture(params=["disk", "redis", "redis-cluster", "shm", "tier"])
def any_store(request, tmp_path, unique_name):
    kind = request.param
    if kind == "disk":
        url = f"disk://{tmp_path}/store"
        yield [url], url, None
    elif kind == "redis":
        url = request.getfixturevalue("redis_server").url + f"?namespace={unique_name}"
        yield [url], url, None
    elif kind == "redis-cluster":
        url = request.getfixturevalue("redis_cluster").url + f"?namespace={unique_name}"
        yield [url], url, None
    elif kind == "shm":
        url = f"shm://{unique_name}?capacity=64MiB"
        server = open_store(url)                # an engine's store: starts the server
        yield [url], url, None
        server.close()
        from store_backends import stop_server

        stop_server(unique_name)
    else:
        fast, slow = f"disk://{tmp_path}/fast", f"disk://{tmp_path}/slow"
        yield [fast, slow], slow, fast


def test_every_store_kind_is_explained(any_store):
    """(For a tier: the first blocks in the fast tier only, the rest in the slow one.)"""
    urls, fill, fast = any_store
    keys = save(fill, ns(), tokens(TEXT))
    delete(fill, [keys[6]])
    if fast is not None:
        with open_store(fill) as slow, open_store(fast) as first:
            assert first.put(keys[:3], slow.get(keys[:3])) == [True] * 3
            slow.delete(keys[:3])
    args = [a for url in urls for a in ("--store", url)]
    result = explain(*args, "--model", TINY, "--prompt", TEXT, "--json")
    assert result.rc == 1, result.stderr
    report = result.report
    assert report["stored_prefix_blocks"] == 6
    assert report["reason"] == "evicted"
    with open_store(urls if fast else fill) as store:
        assert store.contains(keys) == [i != 6 for i in range(len(keys))]


def test_the_store_is_shown_with_its_password_masked(tmp_path):
    from servers import RedisServer

    password = "pw-" + uuid.uuid4().hex[:12]
    server = RedisServer(password=password).start()
    try:
        url = server.url + "?namespace=explain"
        save(url, ns(), tokens(TEXT))
        for extra in ((), ("--json",)):
            result = explain("--store", url, "--model", TINY, "--prompt", TEXT, *extra)
            assert result.rc == 0, result.stderr
            assert password not in result.stdout + result.stderr
            assert f"redis://:***@127.0.0.1:{server.port}/0" in result.stdout
        wrong = url.replace(password, "wrong-" + password)
        result = explain("--store", wrong, "--model", TINY, "--prompt", TEXT)
        assert result.rc == 2
        assert password not in result.stdout + result.stderr
        assert result.stderr.startswith("ucm: ") and result.stderr.count("\n") == 1
    finally:
        server.cleanup()


def test_the_store_is_opened_read_only_nothing_evicted_nothing_created(tmp_path):
    url = f"disk://{tmp_path}/store"
    keys = save(url, ns(), tokens(TEXT))
    result = explain("--store", url + "?capacity=4KiB", "--model", TINY, "--prompt", TEXT, "--json")
    assert result.report["reason"] == "full_hit"
    with open_store(url, OpenMode.INSPECT) as store:
        assert all(store.contains(keys))
    missing = tmp_path / "never-made"
    result = explain("--store", f"disk://{missing}", "--model", TINY, "--prompt", TEXT)
    assert result.rc == 2
    assert result.stderr.startswith("ucm: ") and result.stderr.count("\n") == 1
    assert not missing.exists()


def test_an_shm_store_without_a_server_is_an_error_and_no_server_is_started(unique_name):
    from store_backends import server_running

    result = explain("--store", f"shm://{unique_name}", "--model", TINY, "--prompt", TEXT)
    assert result.rc == 2
    assert result.stderr.startswith("ucm: ")
    assert not server_running(unique_name)


def test_a_store_that_cannot_list_its_keys_is_a_store_failure(thirdparty_entry_point):
    result = explain("--store", "memdict://explain", "--model", TINY, "--prompt", TEXT)
    assert result.rc == 3
    assert result.stderr.startswith("ucm: ") and "cannot list" in result.stderr


# -- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("args, says", [
    (["--model", "/nonexistent/model-dir", "--prompt", "x"], "not a directory"),
    (["--model", TINY, "--token-ids", "/nonexistent/ids.json"], "cannot read token ids file"),
    (["--model", TINY, "--token-ids", "-", "--chat"], "--chat applies to a text prompt"),
    (["--model", TINY, "--prompt", ""], "the prompt is empty"),
    (["--model", TINY, "--prompt", "x", "--namespace", "xyz"], "--namespace"),
    (["--model", TINY, "--prompt", "x", "--block-size", "0"], "--block-size must be at least 1"),
    (["--model", TINY, "--prompt", "x", "--lora", "/nonexistent/adapter"], "--lora"),
])
def test_bad_input_is_one_line_and_exit_status_2(disk, args, says):
    result = explain("--store", disk, *args, stdin="1 2 3")
    assert result.rc == 2
    assert result.stdout == ""
    assert result.stderr.startswith("ucm: ") and result.stderr.count("\n") == 1
    assert says in result.stderr


@pytest.mark.parametrize("text, says", [
    ("[1, 2, 'x']", "not a JSON list"),
    ("[1, 2.5]", "integers only"),
    ("1 2 three", "not a list of token ids"),
    ("1 -2", "out of range"),
    ("", "no token ids"),
])
def test_bad_token_ids_are_refused(disk, text, says):
    result = explain("--store", disk, "--model", TINY, "--token-ids", "-", stdin=text)
    assert result.rc == 2
    assert says in result.stderr


def test_a_malformed_store_url_is_exit_status_2(tmp_path):
    result = explain("--store", "nowhere", "--model", TINY, "--prompt", "x")
    assert result.rc == 2
    assert "is not a URL" in result.stderr


# -- the command's help ---------------------------------------------------------------------

def test_help_lists_every_reason_the_command_gives():
    import re

    from ucm_connector import explain as command
    from ucm_connector import explain_reasons

    with open(explain_reasons.__file__, encoding="utf-8") as f:
        source = f.read()
    # Literal reasons, and those the code composes from names.
    given = set(re.findall(r'report\("([a-z][a-z_]*)",', source)) | {
        "cache_salt", "lora", "cache_salt_and_lora", "other_namespace", "other_model"}
    assert {"full_hit", "diverges", "evicted", "no_model"} <= given
    listed = set(re.findall(r"^  ([a-z_]+(?:, [a-z_]+)*)\s", command.HELP, re.M))
    listed = {name for entry in listed for name in entry.split(", ")}
    assert given <= listed, f"reasons missing from HELP: {sorted(given - listed)}"


def test_help_describes_the_command_with_examples_and_exit_statuses():
    result = explain("--help")
    assert result.rc == 0
    assert "block by block" in result.stdout
    assert "examples:" in result.stdout and "exit status:" in result.stdout
    assert "--cache-salt" in result.stdout and "--token-ids" in result.stdout
