"""The ``ucm`` command, run as a subprocess against real stores: a disk
directory, a real redis-server (and Redis Cluster), real shm servers.

Blocks are real envelopes (blockfmt) under real content addresses (hashing),
with a manifest for one namespace, so each test checks what an operator
would see: counts and bytes per namespace, the bad block named and removed,
only the named namespace cleared, and one-line errors that delete nothing.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import uuid

import numpy as np
import pytest

from servers import RedisServer, free_port
from store_backends import StoreError, check_runtime_dir, open_store, server_running, stop_server
from store_backends.shm import keytable
from ucm_connector import blockfmt
from ucm_connector.config import UCMConfig, UCMConfigError
from ucm_connector.hashing import BlockHasher, Namespace
from ucm_connector.manifest import (
    ManifestError,
    encode_manifest,
    manifest_key,
    parse_manifest,
    read_manifests,
    write_manifest,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NS_A = Namespace(model_fingerprint="a" * 32, dtype="bfloat16", kv_layout="cpu/CPU_ATTN/vec/auto",
                 block_size=16, num_layers=2, num_kv_heads=2, head_size=8, tp_rank=0, tp_size=1)
NS_B = Namespace(model_fingerprint="b" * 32, dtype="float16", kv_layout="cuda/FLASH_ATTN/NHD/auto",
                 block_size=16, num_layers=2, num_kv_heads=2, head_size=8, tp_rank=1, tp_size=2)
MODEL_A = "models/tiny-a"


def ucm(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ucm_connector.cli", *args], input=input, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def blocks(namespace: Namespace, num_blocks: int, payload_nbytes: int, seed: int = 0):
    """Keys and stored values of ``num_blocks`` consecutive blocks of one prompt."""
    tokens = list(range(seed * 10_000, seed * 10_000 + num_blocks * namespace.block_size))
    keys = BlockHasher(namespace).block_keys(tokens)
    rng = np.random.default_rng(seed)
    values = [blockfmt.encode_block(namespace.digest, rng.integers(0, 256, payload_nbytes, dtype=np.uint8),
                                    key=key) for key in keys]
    return keys, values


def put(url: str, keys, values) -> None:
    with open_store(url) as store:
        assert store.put(keys, values) == [True] * len(keys)


def present(url: str, keys) -> list[bool]:
    with open_store(url) as store:
        return store.contains(keys)


def listed(url: str) -> set[bytes]:
    with open_store(url) as store:
        return {key for batch in store.iter_keys() for key in batch}


def damaged(value: bytes, offset: int = blockfmt.HEADER_NBYTES + 7) -> bytes:
    bad = bytearray(value)
    bad[offset] ^= 0xFF
    return bytes(bad)


def replace(url: str, key: bytes, value: bytes) -> None:
    """Overwrite a stored value (puts of a stored key keep the old value)."""
    with open_store(url) as store:
        store.delete([key])
        assert store.put([key], [value]) == [True]


def assert_one_line_error(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("ucm: ")
    for word in words:
        assert word in lines[0]


@pytest.fixture(params=["disk", "redis", "shm"])
def store_url(request, tmp_path):
    kind = request.param
    name = "cli" + uuid.uuid4().hex[:10]
    if kind == "disk":
        yield f"disk://{tmp_path}/store?capacity=64MiB"
    elif kind == "redis":
        yield request.getfixturevalue("redis_server").url + f"?namespace={name}"
    else:
        yield f"shm://{name}?capacity=16MiB"
        stop_server(name)


@pytest.fixture
def filled(store_url):
    """Namespace A (5 blocks, with a manifest) and B (3 blocks, none)."""
    keys_a, values_a = blocks(NS_A, 5, 1000, seed=1)
    keys_b, values_b = blocks(NS_B, 3, 3000, seed=2)
    put(store_url, keys_a + keys_b, values_a + values_b)
    with open_store(store_url) as store:
        assert write_manifest(store, NS_A, model_name=MODEL_A)
    return store_url, (keys_a, values_a), (keys_b, values_b)


# -- the command line itself ----------------------------------------------------------

def test_help_reads_like_a_man_page():
    result = ucm("--help")
    assert result.returncode == 0
    for section in ("commands:", "examples:", "exit status:", "environment:"):
        assert section in result.stdout
    for command in ("store stats", "store verify", "store clear", "config check", "config reference",
                    "shm status", "shm stop"):
        assert command in result.stdout
    verify = ucm("store", "verify", "--help")
    assert verify.returncode == 0 and "--repair" in verify.stdout and "examples:" in verify.stdout


def test_the_installed_script_runs():
    script = os.path.join(os.path.dirname(sys.executable), "ucm")
    if not os.path.exists(script):
        pytest.skip("the package is not installed in this environment (pip install -e .)")
    result = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "ucm-connector" in result.stdout


def test_the_cli_imports_neither_vllm_nor_torch():
    code = ("import sys, ucm_connector.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# -- store stats ------------------------------------------------------------------------

def test_stats_counts_blocks_and_bytes_per_namespace(filled):
    url, (keys_a, values_a), (keys_b, values_b) = filled
    result = ucm("store", "stats", url, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    by_digest = {row["digest"]: row for row in report["namespaces"]}
    assert set(by_digest) == {NS_A.digest.hex(), NS_B.digest.hex()}
    a, b = by_digest[NS_A.digest.hex()], by_digest[NS_B.digest.hex()]
    assert (a["num_blocks"], a["nbytes"]) == (5, sum(map(len, values_a)))
    assert (b["num_blocks"], b["nbytes"]) == (3, sum(map(len, values_b)))
    assert a["manifest"]["model_name"] == MODEL_A and a["manifest"]["namespace"]["tp_rank"] == 0
    assert b["manifest"] is None
    assert report["num_blocks"] == 8 and report["num_keys"] == 9  # 8 blocks + 1 manifest
    if url.startswith("disk://"):
        assert report["capacity_nbytes"] == 64 << 20
        assert a["oldest_use"] is not None and a["oldest_use"] <= a["newest_use"]


def test_stats_as_text_names_the_model_or_says_no_manifest(filled):
    url = filled[0]
    result = ucm("store", "stats", url)
    assert result.returncode == 0, result.stderr
    row_a = next(line for line in result.stdout.splitlines() if line.startswith(NS_A.digest.hex()[:16]))
    row_b = next(line for line in result.stdout.splitlines() if line.startswith(NS_B.digest.hex()[:16]))
    assert MODEL_A in row_a and "tp 0/1" in row_a and "cpu/CPU_ATTN/vec/auto" in row_a
    assert "(no manifest)" in row_b
    assert "2 namespaces, 8 blocks" in result.stdout


def test_stats_on_a_redis_cluster(redis_cluster):
    url = redis_cluster.url + f"?namespace=cli{uuid.uuid4().hex[:10]}"
    keys, values = blocks(NS_A, 40, 500, seed=3)
    put(url, keys, values)
    report = json.loads(ucm("store", "stats", url, "--json").stdout)
    [row] = report["namespaces"]
    assert (row["digest"], row["num_blocks"], row["nbytes"]) == (NS_A.digest.hex(), 40, sum(map(len, values)))


def test_stats_of_a_redis_store_say_what_the_server_figures_count(redis_server):
    url = redis_server.url + f"?namespace=cli{uuid.uuid4().hex[:10]}"
    keys, values = blocks(NS_A, 2, 500, seed=4)
    put(url, keys, values)
    result = ucm("store", "stats", url)
    assert result.returncode == 0, result.stderr
    reported = next(line for line in result.stdout.splitlines() if "the store reports" in line)
    assert "all namespaces" in reported
    store = json.loads(ucm("store", "stats", url, "--json").stdout)["store"]
    assert store["kind"] == "redis" and "all namespaces" in store["counts_scope"]


def test_stats_on_an_empty_store(tmp_path):
    open_store(f"disk://{tmp_path}/empty").close()
    result = ucm("store", "stats", f"disk://{tmp_path}/empty")
    assert result.returncode == 0
    assert "0 namespaces, 0 blocks" in result.stdout


# -- store verify --------------------------------------------------------------------------

def test_verify_reports_a_damaged_block_and_repair_removes_exactly_it(filled):
    url, (keys_a, values_a), (keys_b, _) = filled
    replace(url, keys_a[2], damaged(values_a[2]))
    found = ucm("store", "verify", url)
    assert found.returncode == 1
    bad_lines = [line for line in found.stdout.splitlines() if line.startswith("bad ")]
    assert len(bad_lines) == 1
    assert keys_a[2].hex() in bad_lines[0] and "checksum mismatch" in bad_lines[0]
    assert "7 good, 1 manifest, 1 bad" in found.stdout
    assert present(url, keys_a + keys_b) == [True] * 8  # nothing removed without --repair

    repaired = ucm("store", "verify", url, "--repair")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert "(removed)" in repaired.stdout
    expected = [True] * 8
    expected[2] = False
    assert present(url, keys_a + keys_b) == expected
    assert present(url, [manifest_key(NS_A.digest)]) == [True]

    again = ucm("store", "verify", url, "--json")
    assert again.returncode == 0
    report = json.loads(again.stdout)
    assert (report["good"], report["manifest"], report["bad"]) == (7, 1, 0)


def test_verify_finds_a_byte_flipped_in_a_disk_file(tmp_path):
    from store_backends.disk import block_name

    url = f"disk://{tmp_path}/store"
    keys, values = blocks(NS_A, 4, 4096, seed=4)
    put(url, keys, values)
    path = tmp_path / "store" / block_name(keys[1])[:2] / block_name(keys[1])
    data = bytearray(path.read_bytes())
    data[blockfmt.HEADER_NBYTES + 100] ^= 0x01
    path.write_bytes(bytes(data))
    result = ucm("store", "verify", url, "--repair", "--json")
    assert result.returncode == 0
    report = json.loads(result.stdout)
    assert [b["key"] for b in report["bad_keys"]] == [keys[1].hex()]
    assert "checksum mismatch" in report["bad_keys"][0]["problem"]
    assert present(url, keys) == [True, False, True, True]


def test_verify_reports_a_truncated_disk_file_as_unreadable_and_repair_drops_it(tmp_path):
    from store_backends.disk import block_name

    url = f"disk://{tmp_path}/store"
    keys, values = blocks(NS_A, 3, 2048, seed=11)
    put(url, keys, values)
    path = tmp_path / "store" / block_name(keys[0])[:2] / block_name(keys[0])
    path.write_bytes(path.read_bytes()[:1000])
    found = ucm("store", "verify", url)
    assert found.returncode == 1
    assert keys[0].hex() in found.stdout and "unreadable" in found.stdout
    assert ucm("store", "verify", url, "--repair").returncode == 0
    assert listed(url) == set(keys[1:])


def test_verify_reports_a_block_stored_under_another_key(tmp_path):
    url = f"disk://{tmp_path}/store"
    keys, values = blocks(NS_A, 2, 256, seed=5)
    put(url, [keys[0], keys[1]], [values[0], values[0]])  # block 0's bytes under key 1
    result = ucm("store", "verify", url)
    assert result.returncode == 1
    assert keys[1].hex() in result.stdout and "key mismatch" in result.stdout


def test_verify_shows_progress_only_when_asked(tmp_path):
    url = f"disk://{tmp_path}/store"
    keys, values = blocks(NS_A, 3, 256, seed=6)
    put(url, keys, values)
    quiet = ucm("store", "verify", url)
    assert quiet.returncode == 0 and quiet.stderr == ""
    shown = ucm("store", "verify", url, "--progress")
    assert shown.returncode == 0 and "verify:" in shown.stderr and "3/3 keys" in shown.stderr


# -- a newer format version ------------------------------------------------------------------

def newer_block(namespace: Namespace, key: bytes) -> bytes:
    value = bytearray(blockfmt.encode_block(namespace.digest, b"\x01" * 512, key=key))
    struct.pack_into("<H", value, 4, blockfmt.FORMAT_VERSION + 1)
    return bytes(value)


def test_a_newer_format_version_says_upgrade_and_is_never_removed(tmp_path):
    url = f"disk://{tmp_path}/store"
    keys, values = blocks(NS_A, 3, 256, seed=7)
    put(url, keys[:2] + keys[2:], values[:2] + [newer_block(NS_A, keys[2])])
    stats = ucm("store", "stats", url)
    assert stats.returncode == 4
    assert_one_line_error(stats, "newer", f"format version {blockfmt.FORMAT_VERSION + 1}", "upgrade ucm-connector")
    verify = ucm("store", "verify", url, "--repair")
    assert verify.returncode == 4
    assert_one_line_error(verify, "upgrade ucm-connector")
    assert present(url, keys) == [True, True, True]
    clear = ucm("store", "clear", url, "--namespace", NS_A.digest.hex()[:8], "--yes")
    assert clear.returncode == 0
    assert present(url, keys) == [False, False, True]  # its namespace cannot be read: left alone


# -- store clear ---------------------------------------------------------------------------------

def test_clear_asks_and_an_answer_of_no_deletes_nothing(filled):
    url = filled[0]
    before = listed(url)
    result = ucm("store", "clear", url, input="n\n")
    assert result.returncode == 1
    assert "Delete all 9 keys" in result.stderr and "nothing was deleted" in result.stderr
    assert listed(url) == before
    no_stdin = ucm("store", "clear", url, input="")
    assert no_stdin.returncode == 1 and listed(url) == before


def test_clear_without_a_stdin_is_a_no_that_deletes_nothing(filled):
    """`ucm store clear URL <&-` under cron or systemd: no stdin at all."""
    url = filled[0]
    before = listed(url)
    result = subprocess.run(f"{sys.executable} -m ucm_connector.cli store clear '{url}' <&-", shell=True,
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "no answer" in result.stderr and "nothing was deleted" in result.stderr
    assert listed(url) == before


def test_clear_with_yes_deletes_every_key(filled):
    url = filled[0]
    result = ucm("store", "clear", url, "--yes")
    assert result.returncode == 0, result.stderr
    assert "deleted 9 keys" in result.stdout
    assert listed(url) == set()


def test_clear_after_yes_at_the_prompt(filled):
    url = filled[0]
    result = ucm("store", "clear", url, input="y\n")
    assert result.returncode == 0 and listed(url) == set()


def test_clear_one_namespace_by_model_name_leaves_the_others(filled):
    url, (keys_a, _), (keys_b, _) = filled
    result = ucm("store", "clear", url, "--namespace", "tiny-a", "--yes")
    assert result.returncode == 0, result.stderr
    assert listed(url) == set(keys_b)


def test_clear_one_namespace_by_digest_prefix(filled):
    url, (keys_a, _), (keys_b, _) = filled
    result = ucm("store", "clear", url, "--namespace", NS_B.digest.hex()[:6], "--yes")
    assert result.returncode == 0, result.stderr
    assert listed(url) == set(keys_a) | {manifest_key(NS_A.digest)}


def test_clear_of_an_unknown_namespace_is_an_error_and_deletes_nothing(filled):
    url = filled[0]
    before = listed(url)
    result = ucm("store", "clear", url, "--namespace", "no-such-model", "--yes")
    assert result.returncode == 2
    assert_one_line_error(result, "no namespace 'no-such-model'", "ucm store stats")
    both = ucm("store", "clear", url, "--namespace", "tiny-a", "--namespace", "ffffffff", "--yes")
    assert both.returncode == 2
    assert listed(url) == before


def test_clear_of_a_redis_store_leaves_other_namespaces_alone(redis_server):
    mine = redis_server.url + f"?namespace=cli{uuid.uuid4().hex[:10]}"
    other = redis_server.url + f"?namespace=cli{uuid.uuid4().hex[:10]}"
    keys, values = blocks(NS_A, 3, 128, seed=8)
    put(mine, keys, values)
    put(other, keys, values)
    assert ucm("store", "clear", mine, "--yes").returncode == 0
    assert present(mine, keys) == [False] * 3
    assert present(other, keys) == [True] * 3


# -- bad input: one line, non-zero, nothing deleted ---------------------------------------------

@pytest.mark.parametrize("args, words", [
    (["store", "stats", "not-a-url"], ["not a URL", "scheme://"]),
    (["store", "stats", "ftp://host/x"], ["unknown scheme 'ftp'"]),
    (["store", "verify", "disk:///no/such/ucm/dir"], ["no directory", "check the path"]),
    (["store", "clear", "disk://relative/dir", "--yes"], ["absolute path"]),
    (["store", "stats", "disk:///tmp?capacity=lots"], ["capacity='lots' is not a size"]),
    (["store", "stats", "shm://cli-not-running"], ["no shm server is running", "ucm shm list"]),
    (["shm", "status", "cli-not-running"], ["no shm server is running"]),
    (["shm", "stop", "bad/name", "--yes"], ["not an shm store name"]),
])
def test_bad_input_is_one_line_and_a_non_zero_exit(args, words):
    result = ucm(*args)
    assert result.returncode == 2
    assert_one_line_error(result, *words)


def test_an_unreachable_redis_is_one_line_naming_it_without_the_password():
    url = f"redis://user:s3cret@127.0.0.1:{free_port()}/0"
    for args in (["store", "stats", url], ["store", "clear", url, "--yes"], ["store", "verify", url, "--repair"]):
        result = ucm(*args)
        assert result.returncode == 2
        assert_one_line_error(result, "unreachable", "start redis-server")
        assert "s3cret" not in result.stderr and "user:***@" in result.stderr


def test_a_disk_directory_that_is_not_a_store_is_refused_untouched(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    result = ucm("store", "clear", f"disk://{tmp_path}", "--yes")
    assert_one_line_error(result, "not a disk store")
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]


def test_a_disk_store_is_opened_without_evicting_down_to_the_urls_capacity(tmp_path):
    url = f"disk://{tmp_path}/store"
    keys, values = blocks(NS_A, 8, 4096, seed=9)
    put(url, keys, values)
    result = ucm("store", "stats", url + "?capacity=8KiB", "--json")
    assert result.returncode == 0
    assert json.loads(result.stdout)["namespaces"][0]["num_blocks"] == 8
    assert present(url, keys) == [True] * 8


def test_a_store_that_cannot_list_says_so(thirdparty_entry_point):
    site = next(p for p in sys.path if os.path.isdir(os.path.join(p, "ucm_test_memdict-0.1.dist-info")))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, os.path.dirname(__file__)]))
    result = subprocess.run([sys.executable, "-m", "ucm_connector.cli", "store", "clear", "memdict://x", "--yes"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert result.returncode == 3
    assert_one_line_error(result, "cannot list its blocks")


# -- config check / reference ------------------------------------------------------------------

def test_config_check_accepts_a_good_extra_config(tmp_path):
    config = {"store": f"disk://{tmp_path}/new/store?capacity=1GiB", "min_hit_blocks": 2}
    result = ucm("config", "check", json.dumps(config))
    assert result.returncode == 0, result.stderr
    assert "is valid" in result.stdout and "min_hit_blocks" in result.stdout
    assert "creates it" in result.stdout
    assert not (tmp_path / "new").exists()


def test_config_check_accepts_a_whole_kv_transfer_config(redis_server):
    transfer = {"kv_connector": "UCMConnector", "kv_role": "kv_both",
                "kv_connector_module_path": "ucm_connector.connector",
                "kv_connector_extra_config": {"store": redis_server.url}}
    result = ucm("config", "check", json.dumps(transfer))
    assert result.returncode == 0, result.stderr
    assert "reachable" in result.stdout


def test_config_check_reads_a_yaml_config_file(tmp_path):
    path = tmp_path / "ucm.yaml"
    path.write_text(f"store:\n  - shm://cli-yaml?capacity=8MiB\n  - disk://{tmp_path}/d\ntier_write_mode: sync\n")
    result = ucm("config", "check", str(path))
    assert result.returncode == 0, result.stderr
    assert "the connector starts one" in result.stdout
    assert not server_running("cli-yaml")


def test_config_check_says_a_server_connect_shm_store_needs_a_running_server_and_starts_none(unique_name):
    result = ucm("config", "check", json.dumps({"store": f"shm://{unique_name}?server=connect"}))
    assert result.returncode == 1
    assert "server=connect does not start one" in result.stderr
    assert not server_running(unique_name)


def test_inspecting_an_shm_store_with_no_server_starts_none(unique_name):
    for args in (["store", "stats", f"shm://{unique_name}"], ["store", "verify", f"shm://{unique_name}"]):
        result = ucm(*args)
        assert_one_line_error(result, "no shm server is running", "ucm shm list")
    assert not server_running(unique_name)
    assert not [n for n in os.listdir(check_runtime_dir()) if n.startswith(unique_name + ".")]


@pytest.mark.parametrize("extra", [
    {"stor": "disk:///x"},
    {"store": "nonsense"},
    {"tier_write_mode": "later"},
    {"min_hit_blocks": 0},
])
def test_config_check_rejects_with_the_connectors_own_message(extra):
    with pytest.raises(UCMConfigError) as info:
        UCMConfig.from_extra_config(extra)
    result = ucm("config", "check", json.dumps(extra))
    assert result.returncode == 1
    assert_one_line_error(result, str(info.value))


def test_config_check_names_the_file_like_the_connector(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("stores: disk:///x\n")
    with pytest.raises(UCMConfigError) as info:
        UCMConfig.from_extra_config({"config_file": str(path)})
    result = ucm("config", "check", str(path))
    assert_one_line_error(result, str(info.value))


def test_config_check_reports_an_unreachable_store_unless_told_not_to_connect():
    config = json.dumps({"store": f"redis://127.0.0.1:{free_port()}/0"})
    result = ucm("config", "check", config)
    assert result.returncode == 1
    assert "unreachable" in result.stderr and "Traceback" not in result.stderr
    unopened = ucm("config", "check", config, "--no-connect")
    assert unopened.returncode == 0
    assert "only their URLs' schemes were checked, not their options, hosts or ports" in unopened.stdout
    unknown = ucm("config", "check", json.dumps({"store": ["disk:///tmp/ucm-cli-never", "foo://x"]}), "--no-connect")
    assert unknown.returncode == 1
    assert "unknown scheme 'foo'" in unknown.stderr and "disk, redis" in unknown.stderr


def test_config_check_reports_a_bad_store_option():
    result = ucm("config", "check", json.dumps({"store": "disk:///tmp/ucm-cli-never?capacty=1GiB"}))
    assert result.returncode == 1
    assert "unknown option 'capacty'" in result.stderr
    assert not os.path.exists("/tmp/ucm-cli-never")


def test_config_check_refuses_another_connector_and_bad_arguments():
    other = ucm("config", "check", json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_connector_extra_config": {}}))
    assert_one_line_error(other, "UCMConnector")
    assert_one_line_error(ucm("config", "check", "{not json"), "not valid JSON")
    assert_one_line_error(ucm("config", "check", "no-such-file.yaml"), "neither a file nor a JSON object")


def test_config_reference_prints_the_rendered_reference():
    from ucm_connector.cli import render_configuration_reference

    result = ucm("config", "reference")
    assert result.returncode == 0
    assert result.stdout == render_configuration_reference()


# -- shm ------------------------------------------------------------------------------------------

def test_shm_status_and_stop(unique_name):
    store = open_store(f"shm://{unique_name}?capacity=8MiB")
    keys, values = blocks(NS_A, 2, 1000, seed=10)
    store.put(keys, values)
    try:
        # The open store holds chunks for its next put.
        assert "open write leases 1 (2 chunks, 2 reserved for next puts)" in ucm("shm", "status", unique_name).stdout
        store.close()
        status = ucm("shm", "status", unique_name, "--json")
        assert status.returncode == 0
        assert json.loads(status.stdout)["num_blocks"] == 2
        assert json.loads(status.stdout)["reserved_chunks"] == 0
        if keytable.supported():
            assert json.loads(status.stdout)["key_table_live"] == 2
            text = ucm("shm", "status", unique_name).stdout
            assert "key table answers lookups: 2 keys" in text and "gets find values from it" in text
        assert unique_name in ucm("shm", "list").stdout
        declined = ucm("shm", "stop", unique_name, input="n\n")
        assert declined.returncode == 1 and server_running(unique_name)
        stopped = ucm("shm", "stop", unique_name, "--yes")
        assert stopped.returncode == 0
        assert not server_running(unique_name)
        assert ucm("shm", "status", unique_name).returncode == 2
    finally:
        store.close()
        stop_server(unique_name)


def test_shm_names_starting_with_a_dash_are_names_not_options(unique_name):
    name = "-" + unique_name
    with open_store(f"shm://{name}?capacity=8MiB") as store:
        keys, values = blocks(NS_A, 2, 1000, seed=10)
        store.put(keys, values)
    try:
        status = ucm("shm", "status", name, "--json")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["num_blocks"] == 2
        assert ucm("shm", "status", "--", name).returncode == 0
        assert f"shm://{name} " in ucm("shm", "list").stdout
        stopped = ucm("shm", "stop", name, "--yes")
        assert stopped.returncode == 0, stopped.stderr
        assert not server_running(name)
    finally:
        stop_server(name)


def test_shm_status_still_rejects_an_unknown_option_that_is_not_a_name():
    result = ucm("shm", "status", "cache", "--colour")
    assert result.returncode == 2 and "unrecognized arguments: --colour" in result.stderr


@pytest.mark.parametrize("command", [["list"], ["status", "cache"], ["stop", "cache", "--yes"]])
def test_shm_commands_refuse_a_runtime_dir_others_can_write(tmp_path, command):
    rundir = tmp_path / "run"
    rundir.mkdir(mode=0o700)
    rundir.chmod(0o777)
    result = ucm("shm", *command, "--runtime-dir", str(rundir))
    assert result.returncode == 2
    assert f"the shm runtime directory {rundir}" in result.stderr and "mode 0777" in result.stderr


# -- manifests --------------------------------------------------------------------------------------

def test_a_manifest_round_trips_and_is_checked_against_its_digest(tmp_path):
    url = f"disk://{tmp_path}/m"
    with open_store(url) as store:
        assert write_manifest(store, NS_A, model_name=MODEL_A)
        first = store.get([manifest_key(NS_A.digest)])[0]
        assert write_manifest(store, NS_A, model_name="renamed")  # kept as first written
        assert store.get([manifest_key(NS_A.digest)])[0] == first
        found = read_manifests(store, [NS_A.digest, NS_B.digest])
    assert list(found) == [NS_A.digest]
    assert found[NS_A.digest].model_name == MODEL_A
    assert found[NS_A.digest].namespace == NS_A
    with pytest.raises(ManifestError, match="describes namespace"):
        parse_manifest(encode_manifest(NS_B), NS_A.digest)
    with pytest.raises(ManifestError, match="not valid JSON"):
        parse_manifest(b"\xff\x00", NS_A.digest)


def test_write_manifest_never_raises_for_a_store_that_is_gone_or_full(tmp_path, redis_server):
    closed = open_store(f"disk://{tmp_path}/gone")
    closed.close()
    assert write_manifest(closed, NS_A) is False
    server = RedisServer().start()
    store = open_store(server.url + "?timeout=0.5")
    server.stop()
    try:
        assert write_manifest(store, NS_A) is False
    finally:
        store.close()
        server.cleanup()
    full = open_store(f"disk://{tmp_path}/full?capacity=64")
    assert write_manifest(full, NS_A) is False  # larger than the whole store
    full.close()


def test_a_bad_manifest_is_reported_by_verify(tmp_path):
    url = f"disk://{tmp_path}/store"
    put(url, [manifest_key(NS_A.digest)], [encode_manifest(NS_B)])
    result = ucm("store", "verify", url, "--repair")
    assert "bad manifest" in result.stdout and "describes namespace" in result.stdout
    assert listed(url) == set()


def manifest_with(namespace: Namespace, edit) -> bytes:
    """The manifest of ``namespace`` after ``edit(record)``, as canonical JSON."""
    record = json.loads(encode_manifest(namespace, model_name=MODEL_A))
    edit(record)
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


BAD_MANIFESTS = {
    "integer of 2**63": lambda r: r["namespace"].update(block_size=2 ** 63),
    "unknown namespace field": lambda r: r["namespace"].update(pipeline_stage=1),
    "unknown field": lambda r: r.update(note="hi"),
    "extra not pairs": lambda r: r["namespace"].update(extra=[1, 2], pipeline_stage=1),
}


@pytest.mark.parametrize("edit", list(BAD_MANIFESTS.values()), ids=list(BAD_MANIFESTS))
def test_a_bad_manifest_is_skipped_by_stats_reported_by_verify_and_removed_by_repair(tmp_path, edit):
    url = f"disk://{tmp_path}/store"
    keys, values = blocks(NS_A, 2, 100, seed=4)
    put(url, keys + [manifest_key(NS_A.digest)], values + [manifest_with(NS_A, edit)])

    stats = ucm("store", "stats", url, "--json")
    assert stats.returncode == 0, stats.stderr
    report = json.loads(stats.stdout)
    [row] = report["namespaces"]
    assert (row["digest"], row["num_blocks"], row["manifest"]) == (NS_A.digest.hex(), 2, None)
    assert report["bad_manifests"] == 1
    text = ucm("store", "stats", url)
    assert text.returncode == 0, text.stderr
    assert "bad manifests: 1" in text.stdout and "(bad manifest)" in text.stdout

    verify = ucm("store", "verify", url)
    assert verify.returncode == 1, verify.stderr
    assert "bad manifest" in verify.stdout and "2 good, 0 manifests, 1 bad" in verify.stdout
    repaired = ucm("store", "verify", url, "--repair")
    assert repaired.returncode == 0, repaired.stderr
    assert listed(url) == set(keys)


def test_clear_by_digest_removes_a_bad_manifest_too(tmp_path):
    url = f"disk://{tmp_path}/store"
    put(url, [manifest_key(NS_A.digest)], [manifest_with(NS_A, BAD_MANIFESTS["integer of 2**63"])])
    result = ucm("store", "clear", url, "--namespace", NS_A.digest.hex()[:8], "--yes")
    assert result.returncode == 0, result.stderr
    assert listed(url) == set()


def test_store_errors_from_iter_keys_are_store_errors(tmp_path):
    store = open_store(f"disk://{tmp_path}/x")
    store.close()
    with pytest.raises(StoreError):
        list(store.iter_keys())


# -- the command's package -------------------------------------------------------------------------

def test_a_verify_verdict_is_typed_and_a_newer_block_carries_its_version():
    from ucm_connector.cli import Verdict, check_value

    keys, values = blocks(NS_A, 2, 256, seed=7)
    assert check_value(keys[0], values[0]).verdict is Verdict.GOOD
    bad = check_value(keys[1], damaged(values[1]))
    assert bad.verdict is Verdict.BAD and bad.namespace_digest == NS_A.digest and "checksum" in bad.problem
    newer = check_value(keys[0], newer_block(NS_A, keys[0]))
    assert newer.verdict is Verdict.NEWER and newer.version == blockfmt.FORMAT_VERSION + 1


def test_ucm_explain_is_a_top_level_command(capsys):
    from ucm_connector import explain
    from ucm_connector.cli import build_parser, main

    commands = next(a for a in build_parser()._actions if a.dest == "group").choices
    assert commands["explain"].description == explain.HELP
    with pytest.raises(SystemExit) as exit_:
        main(["explain", "--help"])
    assert exit_.value.code == 0
    assert "--prompt" in capsys.readouterr().out
    assert "explain --store URL --model DIR" in build_parser().format_help()