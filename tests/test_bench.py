"""ucm-bench, run in-process through main([...]) on small blocks."""

from __future__ import annotations

import json
import os
import threading

import pytest

from store_backends import KVStore, StoreStats, register_scheme, registry
from store_backends.bench import main

SMALL = ["--block-kib", "4", "--blocks", "12", "--batch", "4", "--repeat", "2", "--warmup", "1"]


class MemStore(KVStore):
    """A dict behind a lock; remembers which thread put each key."""

    instances: list["MemStore"] = []

    def __init__(self, url: str) -> None:
        self.url = url
        self.data: dict[bytes, bytes] = {}
        self.put_by: dict[bytes, int] = {}
        self.lock = threading.Lock()
        self.closed = False
        MemStore.instances.append(self)

    @classmethod
    def from_url(cls, url: str) -> "MemStore":
        return cls(url)

    def put(self, keys, values):
        with self.lock:
            for key, value in zip(keys, values):
                self.data[bytes(key)] = bytes(value)
                self.put_by[bytes(key)] = threading.get_ident()
        return [True] * len(keys)

    def _read(self, key: bytes) -> bytes | None:
        with self.lock:
            return self.data.get(key)

    def get_into(self, keys, buffers):
        answers = []
        for key, buf in zip(keys, buffers):
            value = self._read(key)
            if value is None or len(value) != len(buf):
                answers.append(False)
                continue
            buf[:] = value
            answers.append(True)
        return answers

    def get(self, keys):
        return [self._read(key) for key in keys]

    def contains(self, keys):
        with self.lock:
            return [key in self.data for key in keys]

    def delete(self, keys):
        with self.lock:
            for key in keys:
                self.data.pop(key, None)

    def stats(self):
        with self.lock:
            return StoreStats(url=self.url, num_blocks=len(self.data))

    def close(self):
        self.closed = True


class FlippingStore(MemStore):
    """Returns block 5 of every round with one byte flipped."""

    def get_into(self, keys, buffers):
        answers = super().get_into(keys, buffers)
        for key, buf, ok in zip(keys, buffers, answers):
            if ok and key.endswith(b":%010d" % 5):
                buf[100] ^= 0x01
        return answers


class ForgetfulStore(MemStore):
    """Says it kept block 7 but drops it."""

    def put(self, keys, values):
        answers = super().put(keys, values)
        self.delete([key for key in keys if key.endswith(b":%010d" % 7)])
        return answers


class LazyStore(MemStore):
    """Answers hits without copying anything into the buffers."""

    def get_into(self, keys, buffers):
        return self.contains(keys)


class DirStore(MemStore):
    """A MemStore that says which directory it lives in, as a disk store does."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        import urllib.parse

        self.root = urllib.parse.urlsplit(url).path


register_scheme("membench", MemStore)
register_scheme("flipbench", FlippingStore)
register_scheme("forgetbench", ForgetfulStore)


@pytest.fixture(autouse=True)
def _fresh_instances():
    MemStore.instances.clear()
    yield
    MemStore.instances.clear()


@pytest.fixture
def as_scheme(monkeypatch):
    """Put a test store under a built-in scheme for one test, so that the raw
    baseline of that scheme runs against its real medium."""

    def install(scheme: str, cls=MemStore) -> None:
        monkeypatch.setitem(registry._registered, scheme, cls.from_url)
    return install


def run_json(tmp_path, *argv: str) -> tuple[int, dict]:
    out = tmp_path / "bench.json"
    status = main([*argv, "--json", str(out), "--quiet"])
    return status, json.loads(out.read_text()) if out.exists() else {}


def assert_positive_figures(report: dict, ops=("put", "get", "contains", "prefix_len")) -> None:
    assert set(report["ops"]) == set(ops)
    for op in ops:
        store = report["ops"][op]["store"]
        assert store["ops_s"] > 0, op
        assert store["latency_ms"]["p50"] > 0, op
        if op in ("put", "get"):
            assert store["gb_s"] > 0, op


def test_json_has_every_op_with_positive_throughput_and_verified(tmp_path):
    status, report = run_json(tmp_path, "--store", "membench://x", *SMALL)
    assert status == 0
    assert report["verified"] is True and report["failures"] == []
    assert_positive_figures(report)
    assert report["block_nbytes"] == 4096 and report["blocks"] == 12
    assert report["threads"] == 1 and report["batch"] == 4 and report["repeat"] == 2
    assert report["host"]["cpu_count"] == os.cpu_count()
    assert report["host"]["python"].count(".") == 2 and report["host"]["date"]


def test_third_party_scheme_has_no_raw_baseline(tmp_path, capsys):
    status = main(["--store", "membench://x", *SMALL])
    assert status == 0
    out = capsys.readouterr().out
    table = out.splitlines()
    put_row = next(line for line in table if line.startswith("put "))
    assert "n/a" in put_row
    assert "no raw baseline for the scheme 'membench'" in out


def test_json_ratio_is_null_without_raw(tmp_path):
    status, report = run_json(tmp_path, "--store", "membench://x", *SMALL)
    assert status == 0
    assert report["raw_medium"] is None
    assert all(fig["raw"] is None and fig["ratio"] is None for fig in report["ops"].values())


def test_password_is_masked_in_json_and_table(tmp_path, capsys):
    out = tmp_path / "b.json"
    status = main(["--store", "membench://user:hunter2@host/0", *SMALL, "--json", str(out)])
    assert status == 0
    assert "hunter2" not in out.read_text()
    assert json.loads(out.read_text())["store"] == "membench://user:***@host/0"
    assert "hunter2" not in capsys.readouterr().out


def test_flipped_byte_exits_1_naming_key_and_block(tmp_path, capsys):
    status, report = run_json(tmp_path, "--store", "flipbench://x", *SMALL)
    assert status == 1
    err = capsys.readouterr().err
    assert "VERIFY FAILED" in err
    assert "block 5" in err and "wrong bytes" in err and ":0000000005'" in err
    assert "first at offset 100" in err
    assert report["verified"] is False
    assert len(report["failures"]) == 3  # once in the warm-up round and once in each timed round


def test_dropped_block_exits_1_naming_the_miss(tmp_path, capsys):
    status, report = run_json(tmp_path, "--store", "forgetbench://x", *SMALL)
    assert status == 1
    err = capsys.readouterr().err
    assert "get missed key" in err and "block 7" in err
    assert "contains says key" in err
    assert any("prefix_len" in f and "returned 7" in f for f in report["failures"])


def test_hit_without_copy_is_caught_in_every_round(tmp_path, capsys, as_scheme):
    # Under shm:// the raw memcpy fills the read buffers with the right bytes
    # after each store get, so only clearing them before the next round
    # catches a store that answers hits without copying.
    as_scheme("shm", LazyStore)
    status, report = run_json(tmp_path, "--store", "shm://lazy", *SMALL)
    assert status == 1
    assert "wrong bytes" in capsys.readouterr().err
    assert len(report["failures"]) == 12 * 3


def test_bench_keys_are_removed_from_the_store(tmp_path):
    status, _ = run_json(tmp_path, "--store", "membench://x", *SMALL)
    assert status == 0
    (store,) = MemStore.instances
    assert store.data == {} and store.closed


def test_keep_leaves_the_last_rounds_blocks(tmp_path):
    status, report = run_json(tmp_path, "--store", "membench://x", *SMALL, "--keep")
    assert status == 0
    (store,) = MemStore.instances
    assert len(store.data) == 12
    assert all(key.startswith(report["kept_key_prefix"].encode()) for key in store.data)


def test_threads_each_put_their_own_contiguous_slice(tmp_path):
    status, report = run_json(tmp_path, "--store", "membench://x", "--block-kib", "4", "--blocks", "10",
                              "--threads", "2", "--batch", "2", "--repeat", "1", "--warmup", "0",
                              "--ops", "put", "--keep")
    assert status == 0
    (store,) = MemStore.instances
    owners = [store.put_by[key] for key in sorted(store.data, key=lambda k: int(k.rsplit(b":", 1)[1]))]
    assert len(set(owners[:5])) == 1 and len(set(owners[5:])) == 1 and owners[0] != owners[5]
    # 5 keys per thread in batches of 2: 3 calls each
    assert report["ops"]["put"]["store"]["calls"] == 6


def test_ops_selects_the_rows(tmp_path):
    status, report = run_json(tmp_path, "--store", "membench://x", *SMALL, "--ops", "get,prefix_len")
    assert status == 0
    assert_positive_figures(report, ops=("get", "prefix_len"))
    assert report["ops"]["prefix_len"]["store"]["keys_per_call"] == 12


def test_tier_has_no_raw_baseline(tmp_path):
    status, report = run_json(tmp_path, "--store", "membench://a", "--store", "membench://b", *SMALL)
    assert status == 0
    assert report["store"] == ["membench://a", "membench://b"]
    assert report["raw_medium"] is None and "tier" in report["raw_description"]
    assert_positive_figures(report)


@pytest.mark.parametrize("argv", [["--store", "not-a-url"], ["--store", "nosuchscheme://x"]])
def test_bad_url_exits_2_with_one_line(argv, capsys):
    assert main([*argv, *SMALL]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err and err.startswith("ucm-bench: error:")


@pytest.mark.parametrize("argv", [["--blocks", "0"], ["--ops", "put,frobnicate"], ["--threads", "13"], []])
def test_bad_arguments_exit_2(argv, capsys):
    store = ["--store", "membench://x"] if argv != [] else []
    assert main([*store, "--block-kib", "4", "--blocks", "12", *argv]) == 2
    assert "ucm-bench" in capsys.readouterr().err


def test_help_exits_0_and_explains_the_raw_media(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for text in ("--store URL", "memcpy", "readinto", "MGET", "mget_nonatomic", "median",
                 "ucm-bench --store redis://", "ucm-bench --store disk://", "ucm-bench --store 'shm://"):
        assert text in out, text


def test_progress_bar_goes_to_stderr_only_when_asked(tmp_path, capsys):
    assert main(["--store", "membench://x", *SMALL, "--progress"]) == 0
    assert "%" in capsys.readouterr().err
    assert main(["--store", "membench://x", *SMALL]) == 0
    assert capsys.readouterr().err == ""


def test_quiet_prints_nothing(tmp_path, capsys):
    assert main(["--store", "membench://x", *SMALL, "--quiet", "--progress"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_json_dash_writes_json_to_stdout(capsys):
    assert main(["--store", "membench://x", *SMALL, "--json", "-"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["verified"] is True
    assert "store/raw" in captured.err


# ---- raw media, with a stand-in store under the built-in scheme


def test_disk_raw_baseline_writes_files_in_the_store_directory_and_removes_them(tmp_path, as_scheme):
    as_scheme("disk", DirStore)
    root = tmp_path / "store"
    root.mkdir()
    status, report = run_json(tmp_path, "--store", f"disk://{root}", *SMALL)
    assert status == 0
    assert report["raw_medium"] == "file" and str(root) in report["raw_description"]
    for op in ("put", "get", "contains", "prefix_len"):
        assert report["ops"][op]["raw"]["ops_s"] > 0 and report["ops"][op]["ratio"] > 0
    assert list(root.iterdir()) == []


def test_shm_raw_baseline_is_memcpy_without_lookups(tmp_path, as_scheme):
    as_scheme("shm")
    status, report = run_json(tmp_path, "--store", "shm://bench", *SMALL)
    assert status == 0
    assert report["raw_medium"] == "memcpy"
    assert report["ops"]["put"]["raw"]["gb_s"] > 0 and report["ops"]["get"]["raw"]["gb_s"] > 0
    assert report["ops"]["contains"]["raw"] is None and report["ops"]["contains"]["ratio"] is None


def test_redis_raw_baseline_uses_the_same_server_and_cleans_up(tmp_path, as_scheme, redis_server):
    import redis

    as_scheme("redis")
    status, report = run_json(tmp_path, "--store", redis_server.url + "?namespace=x", *SMALL)
    assert status == 0
    assert report["raw_medium"] == "redis"
    for op in ("put", "get", "contains", "prefix_len"):
        assert report["ops"][op]["raw"]["ops_s"] > 0
    client = redis.Redis.from_url(redis_server.url)
    assert client.keys("ucm-bench-raw:*") == []
    client.close()


def test_no_raw_skips_the_baseline(tmp_path, as_scheme):
    as_scheme("shm")
    status, report = run_json(tmp_path, "--store", "shm://bench", *SMALL, "--no-raw")
    assert status == 0
    assert report["raw_medium"] is None and "--no-raw" in report["raw_description"]


# ---- the real disk backend, once it exists


def test_real_disk_store(tmp_path):
    pytest.importorskip("store_backends.disk")
    root = tmp_path / "disk"
    root.mkdir()
    status, report = run_json(tmp_path, "--store", f"disk://{root}", *SMALL, "--threads", "2")
    assert status == 0, report.get("failures")
    assert report["verified"] is True and report["raw_medium"] == "file"
    assert_positive_figures(report)
    assert not [p for p in root.rglob("*") if p.name.startswith(".ucm-bench-raw-")]


def test_real_shm_store(tmp_path, unique_name):
    pytest.importorskip("store_backends.shm")
    url = f"shm://{unique_name}?capacity=16MiB&idle_timeout=2s&runtime_dir={tmp_path}"
    status, report = run_json(tmp_path, "--store", url, *SMALL)
    assert status == 0, report.get("failures")
    assert report["verified"] is True and report["raw_medium"] == "memcpy"
    assert_positive_figures(report)


def test_real_redis_store(tmp_path, redis_server, unique_name):
    pytest.importorskip("store_backends.redis")
    import redis

    status, report = run_json(tmp_path, "--store", f"{redis_server.url}?namespace={unique_name}", *SMALL)
    assert status == 0, report.get("failures")
    assert report["verified"] is True and report["raw_medium"] == "redis"
    assert_positive_figures(report)
    client = redis.Redis.from_url(redis_server.url)
    assert client.keys(f"{unique_name}:*") == [] and client.keys("ucm-bench-raw:*") == []
    client.close()
