"""disk:// on its own: URL errors, the file layout, damaged files, capacity
and LRU across restarts, several processes on one directory, a writer
killed mid-put, and a full disk.  The generic KVStore behaviours are in
test_conformance.py.

Every fault here is real: real files altered behind the store's back, real
child processes (killed with SIGKILL, or limited with RLIMIT_FSIZE so their
writes fail with EFBIG).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from store_backends import OpenMode, StoreError, StoreOpenError, open_store, which_store
from store_backends import disk
from store_backends.disk import DiskStore, ReadStatus, block_name, is_disk_store
from store_backends.disk.block_files import BlockFiles

KIB = 1024
MIB = 1024 * 1024
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def value_for(key: bytes, nbytes: int) -> bytes:
    """A reproducible value that differs per key (a reader can check it)."""
    seed = hashlib.sha256(key).digest()
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


def block_path(root, key: bytes) -> str:
    name = block_name(key)
    return os.path.join(str(root), name[:2], name)


def all_files(root) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(str(root)) for f in files]


def temp_files(root) -> list[str]:
    return [p for p in all_files(root) if p.endswith(".tmp")]


def run_child(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, check=False)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def root(tmp_path):
    return tmp_path / "store"


@pytest.fixture
def store(root):
    s = DiskStore.from_url(f"disk://{root}?capacity=64MiB")
    yield s
    s.close()


# ---------------------------------------------------------------- opening


@pytest.mark.parametrize("url, says", [
    ("disk://relative/path", "absolute path"),
    ("disk://host/var/cache", "absolute path"),
    ("disk://", "names no directory"),
    ("disk:///", "names no directory"),
])
def test_a_url_without_an_absolute_path_is_refused(url, says):
    with pytest.raises(StoreOpenError, match=says) as info:
        open_store(url)
    assert url in str(info.value)


def test_unknown_and_malformed_options_are_named(root):
    with pytest.raises(StoreOpenError, match="'colour'"):
        open_store(f"disk://{root}?colour=blue")
    with pytest.raises(StoreOpenError, match="capacity='lots'"):
        open_store(f"disk://{root}?capacity=lots")
    with pytest.raises(StoreOpenError, match="capacity must be more than 0"):
        open_store(f"disk://{root}?capacity=0")
    with pytest.raises(StoreOpenError, match="fsync='maybe'"):
        open_store(f"disk://{root}?fsync=maybe")


def test_a_directory_under_a_regular_file_is_refused_with_the_reason(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"x")
    url = f"disk://{blocker}/sub?capacity=1GiB"
    with pytest.raises(StoreOpenError, match="cannot create the directory") as info:
        open_store(url)
    assert url in str(info.value)
    assert "Not a directory" in str(info.value)


def test_a_read_only_directory_is_refused(tmp_path):
    with pytest.raises(StoreOpenError, match="not writable") as info:
        open_store("disk:///proc/self")
    assert "disk:///proc/self" in str(info.value)


def test_a_missing_directory_is_created_and_options_are_kept(tmp_path):
    root = tmp_path / "deep" / "er" / "store"
    with open_store(f"disk://{root}?capacity=2MiB&fsync=true&touch_interval=250ms") as s:
        assert root.is_dir()
        assert s.put([b"k"], [b"v" * 100]) == [True]
        stats = s.stats()
        assert stats.capacity_nbytes == 2 * MIB
        assert stats.extra["fsync"] is True
        assert stats.url.startswith("disk://")


def test_a_percent_encoded_path_is_decoded(tmp_path):
    with open_store(f"disk://{tmp_path}/with%20space") as s:
        s.put([b"k"], [b"v"])
    assert (tmp_path / "with space" / "index.sqlite").exists()


# ---------------------------------------------------------------- opening for inspection


def test_inspect_mode_refuses_a_directory_that_is_not_a_store_and_leaves_it_untouched(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    url = f"disk://{tmp_path}?capacity=1GiB"
    with pytest.raises(StoreOpenError, match="is not a disk store") as info:
        open_store(url, OpenMode.INSPECT)
    assert url in str(info.value) and "check the path" in str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]


def test_inspect_mode_refuses_a_missing_directory_without_creating_it(tmp_path):
    root = tmp_path / "no" / "store"
    with pytest.raises(StoreOpenError, match="there is no directory"):
        open_store(f"disk://{root}", "inspect")
    assert not (tmp_path / "no").exists()


def test_inspect_mode_still_refuses_bad_options(tmp_path):
    with pytest.raises(StoreOpenError, match="capacity='lots'"):
        open_store(f"disk://{tmp_path}?capacity=lots", OpenMode.INSPECT)


def test_inspect_mode_opens_a_store_without_evicting_down_to_the_urls_capacity(root):
    keys = [b"k%d" % i for i in range(8)]
    values = [value_for(k, 4 * KIB) for k in keys]
    with open_store(f"disk://{root}") as s:
        assert s.put(keys, values) == [True] * 8

    with open_store(f"disk://{root}?capacity=8KiB", OpenMode.INSPECT) as s:
        assert s.contains(keys) == [True] * 8
        assert s.put([b"one-more"], [value_for(b"one-more", 4 * KIB)]) == [True]
        assert s.get(keys) == values
        stats = s.stats()
    assert (stats.num_blocks, stats.num_evictions) == (9, 0)
    assert stats.capacity_nbytes == 8 * KIB  # reported, not enforced
    with open_store(f"disk://{root}") as s:
        assert s.contains(keys + [b"one-more"]) == [True] * 9


def test_is_disk_store_knows_a_store_by_its_index_or_its_shard_directories(tmp_path):
    root = tmp_path / "store"
    assert not is_disk_store(str(root))
    root.mkdir()
    assert not is_disk_store(str(root))
    with open_store(f"disk://{root}") as s:
        s.put([b"k"], [b"v"])
    assert is_disk_store(str(root))
    for name in os.listdir(root):
        if name.startswith("index.sqlite"):
            os.unlink(root / name)
    assert is_disk_store(str(root))  # a lost index is rebuilt from the files at open
    (tmp_path / "a-file").write_bytes(b"x")
    assert not is_disk_store(str(tmp_path / "a-file"))


def test_which_store_names_a_disk_store_and_creates_nothing_where_there_is_none(tmp_path):
    with open_store(f"disk://{tmp_path}/store") as s:
        s.put([b"k"], [b"v"])
    (tmp_path / "plain").mkdir()
    assert which_store(f"disk://{tmp_path}/store") == "disk"
    assert which_store(f"disk://{tmp_path}/plain") is None
    assert which_store(f"disk://{tmp_path}/missing") is None
    assert os.listdir(tmp_path / "plain") == [] and not (tmp_path / "missing").exists()


# ---------------------------------------------------------------- layout


def test_hostile_keys_only_ever_create_hashed_files_inside_the_store(tmp_path, root):
    keys = [b"../../escape", b"../" * 40 + b"etc/passwd", b"/abs", b"\x00name", b"a\x00/../b",
            b"x" * 5000, b"..", b"COM1", b"sub/dir/file"]
    with DiskStore(str(root)) as s:
        assert s.put(keys, [value_for(k, 300) for k in keys]) == [True] * len(keys)
        assert s.get(keys) == [value_for(k, 300) for k in keys]
    outside = {p.name for p in tmp_path.iterdir()}
    assert outside == {"store"}
    blocks = [p for p in all_files(root) if os.path.basename(p) not in ("index.sqlite", "open.lock")
              and "index.sqlite" not in p]
    assert len(blocks) == len(keys)
    for path in blocks:
        name = os.path.basename(path)
        assert len(name) == 32 and all(c in "0123456789abcdef" for c in name)
        assert os.path.dirname(path) == os.path.join(str(root), name[:2])


def test_a_stored_file_holds_its_key_and_exactly_its_value(root, store):
    store.put([b"key"], [b"value-bytes"])
    data = open(block_path(root, b"key"), "rb").read()
    assert data.startswith(b"value-bytes" + b"key")
    assert data.endswith(disk._MAGIC)
    assert len(data) == 11 + 3 + disk._TRAILER.size


def test_an_empty_value_round_trips(store):
    assert store.put([b"empty"], [b""]) == [True]
    assert store.get([b"empty"]) == [b""]
    assert store.get_into([b"empty"], [bytearray(0)]) == [True]


# ---------------------------------------------------------------- damaged files


@pytest.mark.parametrize("reader", ["get", "get_into"])
@pytest.mark.parametrize("damage", ["truncate", "extend", "length-field", "magic", "empty"])
def test_a_damaged_file_is_a_counted_miss_and_is_removed(root, store, damage, reader):
    value = value_for(b"victim", 64 * KIB)
    store.put([b"victim", b"bystander"], [value, b"ok"])
    path = block_path(root, b"victim")
    data = bytearray(open(path, "rb").read())
    if damage == "truncate":
        data = data[:-1]
    elif damage == "extend":
        data += b"\x00"
    elif damage == "length-field":
        data[-20:-12] = (len(value) - 10).to_bytes(8, "little")
    elif damage == "magic":
        data[-1] ^= 0xFF
    else:
        data = bytearray()
    with open(path, "wb") as f:
        f.write(data)

    if reader == "get":
        assert store.get([b"victim", b"bystander"]) == [None, b"ok"]
    else:
        assert store.get_into([b"victim"], [bytearray(len(value))]) == [False]
    assert store.get([b"victim"]) == [None]
    stats = store.stats()
    assert stats.num_corrupt == 1
    assert stats.num_blocks == 1
    assert not os.path.exists(path)
    assert store.contains([b"victim"]) == [False]
    assert store.put([b"victim"], [value]) == [True]
    assert store.get([b"victim"]) == [value]


@pytest.mark.parametrize("damage, status", [
    ("none", ReadStatus.HIT),
    ("missing", ReadStatus.GONE),
    ("truncate", ReadStatus.CORRUPT),
    ("another size", ReadStatus.MISS),
])
def test_a_block_file_read_says_what_it_found(root, damage, status):
    files = BlockFiles(str(root))
    files.make_shards()
    value = value_for(b"key", 1000)
    inode = files.publish(b"key", memoryview(value))
    path = files.path(b"key")
    if damage == "missing":
        os.unlink(path)
    elif damage == "truncate":
        os.truncate(path, 500)
    expected = 999 if damage == "another size" else len(value)
    read = files.read_into(b"key", [memoryview(bytearray(expected))])
    assert read.status is status
    assert read.inode == (inode if status is ReadStatus.CORRUPT else None)
    if damage == "none":
        assert files.read(b"key").value == value


def test_a_length_field_that_disagrees_with_the_file_size_is_never_trusted(root, store):
    # The value ends with the key's bytes, so a shortened length field would
    # find a matching key: only the size check tells the value is not whole.
    value = b"x" * 50 + b"k"
    store.put([b"k"], [value])
    path = block_path(root, b"k")
    data = bytearray(open(path, "rb").read())
    data[-20:-12] = (len(value) - 1).to_bytes(8, "little")
    with open(path, "wb") as f:
        f.write(data)
    assert store.get([b"k"]) == [None]
    assert store.get_into([b"k"], [bytearray(len(value) - 1)]) == [False]
    assert store.stats().num_corrupt == 1


def test_get_truncated_behind_the_stores_back_is_never_returned(root, store):
    value = value_for(b"t", 32 * KIB)
    store.put([b"t"], [value])
    os.truncate(block_path(root, b"t"), 16 * KIB)
    assert store.get([b"t"]) == [None]
    assert store.stats().num_corrupt == 1


def test_a_file_holding_another_key_is_never_returned_for_this_key(root, store):
    store.put([b"real"], [b"the real value"])
    store.put([b"other"], [b"the other value"])
    os.replace(block_path(root, b"other"), block_path(root, b"real"))
    assert store.get([b"real"]) == [None]
    assert store.get_into([b"real"], [bytearray(len(b"the other value"))]) == [False]


def test_a_buffer_of_the_wrong_size_is_a_miss_that_keeps_the_block(root, store):
    store.put([b"k"], [b"x" * 1000])
    assert store.get_into([b"k"], [bytearray(999)]) == [False]
    assert store.get_into([b"k"], [bytearray(1001)]) == [False]
    assert store.stats().num_corrupt == 0
    assert os.path.exists(block_path(root, b"k"))
    buf = bytearray(1000)
    assert store.get_into([b"k"], [buf]) == [True] and buf == b"x" * 1000


def test_a_file_removed_behind_the_stores_back_drops_its_row(root, store):
    store.put([b"gone", b"kept"], [b"1" * 10, b"2" * 10])
    os.unlink(block_path(root, b"gone"))
    assert store.contains([b"gone"]) == [True]  # the index cannot know yet
    assert store.get([b"gone"]) == [None]
    assert store.contains([b"gone", b"kept"]) == [False, True]
    assert store.stats().num_blocks == 1
    assert store.stats().nbytes == 10


def test_a_put_over_a_row_whose_file_vanished_writes_the_file_again(root, store):
    store.put([b"k"], [b"first"])
    os.unlink(block_path(root, b"k"))
    assert store.put([b"k"], [b"first"]) == [True]
    assert store.get([b"k"]) == [b"first"]


def test_putting_a_present_key_again_does_not_rewrite_its_file(root, store):
    store.put([b"k"], [b"v" * 4096])
    before = os.stat(block_path(root, b"k"))
    assert store.put([b"k", b"k"], [b"v" * 4096, b"v" * 4096]) == [True, True]
    after = os.stat(block_path(root, b"k"))
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert store.stats().num_blocks == 1


# ---------------------------------------------------------------- capacity and LRU


def test_capacity_evicts_the_least_recently_used_block(root):
    with DiskStore.from_url(f"disk://{root}?capacity=16KiB") as s:
        keys = [b"a", b"b", b"c", b"d"]
        s.put(keys, [value_for(k, 4 * KIB) for k in keys])
        s.get([b"a"])
        assert s.put([b"e"], [value_for(b"e", 4 * KIB)]) == [True]
        assert s.contains([b"a", b"b", b"c", b"d", b"e"]) == [True, False, True, True, True]
        assert not os.path.exists(block_path(root, b"b"))
        stats = s.stats()
        assert stats.num_evictions == 1
        assert stats.nbytes == 16 * KIB and stats.num_blocks == 4


def test_a_value_larger_than_the_capacity_is_refused_without_leftovers(root):
    with DiskStore.from_url(f"disk://{root}?capacity=8KiB") as s:
        s.put([b"small"], [b"s" * 100])
        assert s.put([b"huge"], [b"h" * (8 * KIB + 1)]) == [False]
        assert s.contains([b"huge", b"small"]) == [False, True]
        assert not os.path.exists(block_path(root, b"huge"))
        assert temp_files(root) == []
        assert s.stats().num_put_failures == 1


def test_a_batch_larger_than_the_capacity_keeps_its_newest_blocks(root):
    with DiskStore.from_url(f"disk://{root}?capacity=8KiB") as s:
        keys = [b"k%d" % i for i in range(5)]
        assert s.put(keys, [b"x" * (2 * KIB)] * 5) == [False, True, True, True, True]
        assert s.contains(keys) == [False, True, True, True, True]
        assert s.stats().nbytes == 8 * KIB


def test_lru_order_survives_a_restart(root):
    url = f"disk://{root}?capacity=12KiB&touch_interval=1h"
    with open_store(url) as s:
        s.put([b"a", b"b", b"c"], [b"1" * 4096, b"2" * 4096, b"3" * 4096])
        s.get([b"a"])  # held back by touch_interval, written by close()
    child = run_child("""
        import sys
        from store_backends import open_store
        with open_store(sys.argv[1]) as s:
            s.put([b"d"], [b"4" * 4096])
            print(s.contains([b"a", b"b", b"c", b"d"]))
    """, url)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "[True, False, True, True]"


def test_reopening_with_a_smaller_capacity_evicts_down_to_it(root):
    with DiskStore.from_url(f"disk://{root}?capacity=1MiB") as s:
        keys = [b"k%d" % i for i in range(8)]
        s.put(keys, [b"x" * (64 * KIB)] * 8)
    with DiskStore.from_url(f"disk://{root}?capacity=256KiB") as s:
        assert s.contains(keys) == [False] * 4 + [True] * 4
        assert s.stats().nbytes == 256 * KIB
        assert len([p for p in all_files(root) if len(os.path.basename(p)) == 32]) == 4


def test_usage_is_shared_and_bounded_across_processes(root):
    url = f"disk://{root}?capacity=256KiB"
    code = """
        import sys
        from store_backends import open_store
        with open_store(sys.argv[1]) as s:
            for i in range(60):
                key = b"%s-%d" % (sys.argv[2].encode(), i)
                assert s.put([key], [bytes([i]) * 16384]) == [True]
    """
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), url, name], cwd=REPO,
                              stderr=subprocess.PIPE, text=True) for name in ("p", "q")]
    for p in procs:
        assert p.wait(timeout=60) == 0, p.stderr.read()
    with open_store(url) as s:
        stats = s.stats()
        assert stats.nbytes <= 256 * KIB
        assert stats.num_blocks == 16
        files = [p for p in all_files(root) if len(os.path.basename(p)) == 32]
        assert len(files) == 16
        assert sum(os.path.getsize(p) for p in files) < 256 * KIB + 16 * 64
        assert temp_files(root) == []


# ---------------------------------------------------------------- several processes


def test_another_processs_puts_and_deletes_are_seen_by_an_open_store(root, store):
    url = f"disk://{root}"
    assert store.contains([b"from-child"]) == [False]
    store.put([b"from-parent"], [b"p"])
    child = run_child("""
        import sys
        from store_backends import open_store
        with open_store(sys.argv[1]) as s:
            s.put([b"from-child"], [b"c" * 5000])
            s.delete([b"from-parent"])
    """, url)
    assert child.returncode == 0, child.stderr
    assert store.contains([b"from-child", b"from-parent"]) == [True, False]
    assert store.prefix_len([b"from-child", b"from-parent"]) == 1
    assert store.get([b"from-child", b"from-parent"]) == [b"c" * 5000, None]


def test_a_trimmed_journal_makes_an_open_store_reload_its_key_set(root, monkeypatch):
    from store_backends.disk import index as disk_index

    monkeypatch.setattr(disk_index, "_JOURNAL_KEEP", 4)
    monkeypatch.setattr(disk_index, "_TRIM_EVERY", 1)
    with DiskStore(str(root)) as reader, DiskStore(str(root)) as writer:
        reader.put([b"old"], [b"o"])
        assert reader.contains([b"old"]) == [True]
        for i in range(40):
            writer.put([b"n%d" % i], [b"x"])
        writer.delete([b"old"])
        trimmed = sqlite3.connect(str(root / "index.sqlite")).execute(
            "SELECT trimmed_seq FROM usage").fetchone()[0]
        assert trimmed > reader._index.seq
        keys = [b"old"] + [b"n%d" % i for i in range(40)]
        assert reader.contains(keys) == [False] + [True] * 40


def test_two_processes_writing_the_same_keys_leave_only_whole_values(root):
    url = f"disk://{root}?capacity=64MiB"
    code = """
        import hashlib, sys
        from store_backends import open_store
        tag = sys.argv[2].encode()
        with open_store(sys.argv[1]) as s:
            for round in range(3):
                for i in range(24):
                    key = b"shared-%d" % i
                    seed = hashlib.sha256(tag + key).digest()
                    s.put([key], [seed * (262144 // 32 + i)])
                s.delete([b"shared-%d" % i for i in range(0, 24, 3)])
    """
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), url, tag], cwd=REPO,
                              stderr=subprocess.PIPE, text=True) for tag in ("A", "B")]
    for p in procs:
        assert p.wait(timeout=60) == 0, p.stderr.read()
    with open_store(url) as s:
        keys = [b"shared-%d" % i for i in range(24)]
        got = s.get(keys)
        assert any(v is not None for v in got)
        for i, (key, value) in enumerate(zip(keys, got)):
            if value is None:
                continue
            whole = [hashlib.sha256(t + key).digest() * (262144 // 32 + i) for t in (b"A", b"B")]
            assert value in whole, f"{key!r} holds a mixed or partial value"
        assert s.stats().num_corrupt == 0
        assert temp_files(root) == []


KILLED_WRITER = """
    import hashlib, sys
    from store_backends import open_store
    run = sys.argv[2].encode()
    with open_store(sys.argv[1]) as s:
        for i in range(10**6):
            key = b"kill-%s-%d" % (run, i)
            seed = hashlib.sha256(key).digest()
            s.put([key, key + b"-b"], [seed * (4 << 20 >> 5), seed * (1 << 20 >> 5)])
            if i % 10 == 9:
                s.delete([b"kill-%s-%d" % (run, i - 5)])
            print(i, flush=True)
"""


def killed_writer_value(key: bytes) -> bytes:
    seed = hashlib.sha256(key.removesuffix(b"-b")).digest()
    return seed * (((1 << 20) if key.endswith(b"-b") else (4 << 20)) >> 5)


def test_a_writer_killed_mid_put_leaves_only_whole_values_and_no_garbage(root):
    url = f"disk://{root}?capacity=48MiB"
    DiskStore.from_url(url).close()
    last: dict[int, int] = {}
    for run, delay in enumerate((0.03, 0.07, 0.11, 0.17, 0.23, 0.29)):
        proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILLED_WRITER), url, str(run)],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout.readline(), proc.stderr.read()
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        last[run] = int(([b"0"] + proc.stdout.read().split())[-1]) + 2
        proc.stdout.close()
        proc.stderr.close()

    with open_store(url) as s:
        assert temp_files(root) == [], "the killed writers' temp files were not swept at open"
        keys = [b"kill-%d-%d%s" % (run, i, tail) for run, n in last.items() for i in range(n)
                for tail in (b"", b"-b")]
        got = s.get(keys)
        assert sum(v is not None for v in got) >= 4
        for key, value in zip(keys, got):
            if value is not None:
                assert value == killed_writer_value(key), f"{key!r} is not whole"
        stats = s.stats()
        assert stats.num_corrupt == 0
        assert stats.nbytes <= 48 * MIB
        files = [p for p in all_files(root) if len(os.path.basename(p)) == 32]
        assert stats.num_blocks == len(files), "a file is left without a row, or a row without a file"
        assert stats.nbytes == sum(len(v) for v in got if v is not None)


def test_a_writer_killed_in_the_middle_of_writing_a_block_leaves_no_partial_block(root):
    url = f"disk://{root}"
    DiskStore.from_url(url).close()
    code = """
        import sys
        from store_backends import open_store
        value = b"v" * (64 << 20)
        with open_store(sys.argv[1]) as s:
            for i in range(1000):
                s.put([b"huge-%d" % i], [value])
    """
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), url], cwd=REPO)
    full = (64 << 20) + disk._TRAILER.size + len(b"huge-0")
    caught = None
    deadline = time.monotonic() + 30
    while caught is None and time.monotonic() < deadline and proc.poll() is None:
        for path in all_files(root):
            try:
                size = os.path.getsize(path)
            except OSError:
                continue
            if 0 < size < full - 1 and "index.sqlite" not in path:
                proc.send_signal(signal.SIGKILL)
                caught = path
                break
    proc.kill()
    proc.wait()
    assert caught is not None, "never saw a block being written"
    assert os.path.getsize(caught) < full, "the kill should have left this file unfinished"

    with open_store(url) as s:
        keys = [b"huge-%d" % i for i in range(1000)]
        present = [k for k, hit in zip(keys, s.contains(keys)) if hit]
        partial_keys = [k for k in keys if k not in present]
        assert s.get(partial_keys[:1]) == [None]
        for key in present:
            buf = bytearray(64 << 20)
            assert s.get_into([key], [buf]) == [True] and buf.count(b"v") == len(buf)
        assert s.stats().num_corrupt == 0
        assert temp_files(root) == []
        files = [p for p in all_files(root) if len(os.path.basename(p)) == 32]
        assert len(files) == len(present) == s.stats().num_blocks


# ---------------------------------------------------------------- crash leftovers and the index


def test_stale_temp_files_of_dead_writers_are_swept_at_open(root):
    DiskStore(str(root)).close()
    name = block_name(b"k")
    dead = root / name[:2] / f"{name}.{dead_pid()}.0.tmp"
    live = root / name[:2] / f"{name}.{os.getpid()}.999999.tmp"
    old = root / name[:2] / f"{name}.{os.getpid()}.999998.tmp"
    for path in (dead, live, old):
        path.write_bytes(b"partial")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    DiskStore(str(root)).close()
    assert not dead.exists()
    assert not old.exists()
    assert live.exists(), "a temp file of a live writer must be left alone"


def test_a_published_file_without_a_row_is_adopted_at_open(root):
    with DiskStore(str(root)) as s:
        s.put([b"orphan", b"other"], [b"o" * 300, b"x"])
    db = sqlite3.connect(str(root / "index.sqlite"))
    with db:
        db.execute("DELETE FROM blocks WHERE key = ?", (b"orphan",))
    db.close()
    with DiskStore(str(root)) as s:
        assert s.contains([b"orphan"]) == [True]
        assert s.stats().num_blocks == 2 and s.stats().nbytes == 301
        assert s.get([b"orphan"]) == [b"o" * 300]


def test_a_junk_file_with_a_block_name_is_removed_at_open(root):
    DiskStore(str(root)).close()
    name = block_name(b"nothing")
    junk = root / name[:2] / name
    junk.write_bytes(b"not a block at all")
    with DiskStore(str(root)) as s:
        assert not junk.exists()
        assert s.stats().num_corrupt == 1
        assert s.stats().num_blocks == 0


@pytest.mark.parametrize("how", ["deleted", "garbage"])
def test_a_lost_or_corrupt_index_is_rebuilt_from_the_files(root, how):
    keys = [b"r%d" % i for i in range(30)]
    with DiskStore.from_url(f"disk://{root}?capacity=1MiB") as s:
        s.put(keys, [value_for(k, 1000 + i) for i, k in enumerate(keys)])
    for suffix in ("", "-wal", "-shm"):
        path = root / ("index.sqlite" + suffix)
        if path.exists():
            path.unlink()
    if how == "garbage":
        (root / "index.sqlite").write_bytes(os.urandom(8192))
    with DiskStore.from_url(f"disk://{root}?capacity=1MiB") as s:
        assert s.contains(keys) == [True] * 30
        assert s.get(keys) == [value_for(k, 1000 + i) for i, k in enumerate(keys)]
        stats = s.stats()
        assert stats.num_blocks == 30
        assert stats.nbytes == sum(1000 + i for i in range(30))


# ---------------------------------------------------------------- full disk


def test_a_full_disk_makes_put_return_false_and_leaves_nothing_behind(root):
    url = f"disk://{root}"
    DiskStore.from_url(url).close()
    child = run_child("""
        import json, resource, signal, sys
        from store_backends import open_store
        s = open_store(sys.argv[1])
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, resource.RLIM_INFINITY))
        out = {
            "big": s.put([b"big"], [b"b" * (1 << 20)]),
            "mixed": s.put([b"small", b"big2"], [b"s" * 1000, b"c" * (300 * 1024)]),
        }
        out["stats"] = s.stats().num_put_failures
        s.close()
        print(json.dumps(out))
    """, url)
    assert child.returncode == 0, child.stderr
    out = json.loads(child.stdout)
    assert out == {"big": [False], "mixed": [True, False], "stats": 2}
    assert temp_files(root) == []
    with open_store(url) as s:
        assert s.contains([b"big", b"small", b"big2"]) == [False, True, False]
        assert s.get([b"small"]) == [b"s" * 1000]
        assert s.stats().num_blocks == 1
    assert not os.path.exists(block_path(root, b"big"))


@pytest.fixture
def small_fs(tmp_path):
    """A real file system of 4 MiB (tmpfs) of our own, to fill to 100%."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    if not shutil.which("mount") or (sudo and not shutil.which("sudo")):
        pytest.skip("cannot mount a small tmpfs to fill: needs the mount command, and root or passwordless sudo")
    mounted = subprocess.run(
        [*sudo, "mount", "-t", "tmpfs", "-o", f"size=4m,uid={os.getuid()},gid={os.getgid()}", "ucm-test-fs",
         str(mnt)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill ({mounted.stderr.strip()}): "
                    f"needs root or passwordless sudo")
    yield mnt
    if subprocess.run([*sudo, "umount", str(mnt)], capture_output=True).returncode != 0:
        subprocess.run([*sudo, "umount", "-l", str(mnt)], capture_output=True)


def fill(directory) -> str:
    """Write a file in ``directory`` until its file system has no byte
    left; removing the file gives the space back."""
    path = os.path.join(str(directory), "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for chunk in (bytes(64 * KIB), bytes(1)):
            with pytest.raises(OSError) as info:
                while True:
                    os.write(fd, chunk)
            assert info.value.errno == errno.ENOSPC
    finally:
        os.close(fd)
    assert os.statvfs(str(directory)).f_bavail == 0
    return path


def test_a_store_on_a_full_file_system_opens_reads_hit_and_puts_are_refused(small_fs):
    root = small_fs / "store"
    keys = [b"k%d" % i for i in range(8)]
    values = [value_for(k, 64 * KIB) for k in keys]
    with open_store(f"disk://{root}") as s:
        assert s.put(keys, values) == [True] * 8
    fill(small_fs)

    with open_store(f"disk://{root}?capacity=1GiB") as s:
        assert s.get(keys) == values
        buffers = [bytearray(64 * KIB) for _ in range(2)]
        assert s.get_into(keys[:2], buffers) == [True, True] and buffers == values[:2]
        assert s.contains(keys + [b"nope"]) == [True] * 8 + [False]
        assert s.prefix_len(keys + [b"nope"]) == 8
        assert s.put([b"new"], [b"x" * 1000]) == [False]
        stats = s.stats()
    assert "no space left on device" in stats.extra["read_only"]
    assert (stats.num_hits, stats.num_put_failures) == (10, 1)
    assert temp_files(root) == [] and not os.path.exists(block_path(root, b"new"))


def test_a_new_store_on_a_full_file_system_opens_empty_and_refuses_puts(small_fs):
    fill(small_fs)
    with open_store(f"disk://{small_fs}/new") as s:
        assert s.contains([b"k"]) == [False] and s.get([b"k"]) == [None]
        assert s.put([b"k"], [b"v"]) == [False]
        assert "no space left on device" in s.stats().extra["read_only"]


def test_stats_of_a_store_on_a_full_file_system_say_it_is_read_only(small_fs):
    root = small_fs / "store"
    with open_store(f"disk://{root}") as s:
        assert s.stats().read_only is None
    fill(small_fs)
    with open_store(f"disk://{root}") as s:
        stats = s.stats()
    assert stats.kind == "disk"
    assert "no space left on device" in stats.read_only


def test_a_store_opened_on_a_full_file_system_stores_again_once_space_is_freed(small_fs, monkeypatch):
    from store_backends.disk import store as disk_store

    monkeypatch.setattr(disk_store, "_FULL_RETRY_SECONDS", 0.0)
    root = small_fs / "store"
    with open_store(f"disk://{root}") as s:
        assert s.put([b"old"], [b"o" * 1000]) == [True]
    filler = fill(small_fs)
    with open_store(f"disk://{root}") as s:
        assert s.put([b"new"], [b"n" * 1000]) == [False]
        os.unlink(filler)
        assert s.put([b"new"], [b"n" * 1000]) == [True]
        assert "read_only" not in s.stats().extra
    with open_store(f"disk://{root}") as s:
        assert s.get([b"old", b"new"]) == [b"o" * 1000, b"n" * 1000]
        assert s.stats().num_blocks == 2


def test_ucm_store_stats_and_clear_work_on_a_full_file_system(small_fs):
    url = f"disk://{small_fs}/store"
    keys = [b"k%d" % i for i in range(8)]
    with open_store(url) as s:
        assert s.put(keys, [value_for(k, 64 * KIB) for k in keys]) == [True] * 8
    fill(small_fs)

    def ucm(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ucm_connector.cli", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=60)

    stats = ucm("store", "stats", url, "--json")
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["num_keys"] == 8
    text = ucm("store", "stats", url)
    assert "read-only: no space left on device" in text.stdout, text.stdout + text.stderr
    cleared = ucm("store", "clear", url, "--yes")
    assert cleared.returncode == 0, cleared.stderr
    assert "deleted 8 keys" in cleared.stdout
    with open_store(url) as s:  # clearing gave the space back: a normal store again
        assert [k for batch in s.iter_keys() for k in batch] == []
        assert s.stats().num_blocks == 0
        assert s.put([b"k"], [b"v"]) == [True]


# ---------------------------------------------------------------- threads and lifecycle


def test_threads_sharing_one_store_under_eviction_read_only_whole_values(root):
    errors: list[str] = []
    with DiskStore.from_url(f"disk://{root}?capacity=512KiB") as s:
        def worker(t: int) -> None:
            for i in range(60):
                key = b"%d-%d" % (t, i % 25)
                s.put([key], [value_for(key, 16 * KIB)])
                read = [key, b"0-%d" % (i % 25)]
                for other, value in zip(read, s.get(read)):
                    if value is not None and value != value_for(other, 16 * KIB):
                        errors.append(f"{other!r}: wrong bytes")
                s.contains([b"%d-%d" % (t, j) for j in range(25)])

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        stats = s.stats()
        assert errors == []
        assert stats.nbytes <= 512 * KIB
        assert stats.num_evictions > 0
        assert stats.num_corrupt == 0


def test_a_closed_store_refuses_work_and_close_twice_is_fine(root):
    s = DiskStore(str(root))
    s.put([b"k"], [b"v"])
    s.close()
    s.close()
    with pytest.raises(StoreError, match="closed"):
        s.get([b"k"])
    with pytest.raises(StoreError, match="closed"):
        s.put([b"k"], [b"v"])


def test_stats_describe_the_store(root):
    with DiskStore.from_url(f"disk://{root}?capacity=1MiB") as s:
        s.put([b"a", b"b"], [b"x" * 10, b"y" * 20])
        s.get([b"a", b"nope"])
        stats = s.stats()
    assert stats.url == f"disk://{root}?capacity=1MiB"
    assert (stats.num_blocks, stats.nbytes, stats.capacity_nbytes) == (2, 30, MIB)
    assert (stats.num_puts, stats.num_gets, stats.num_hits, stats.num_misses) == (2, 2, 1, 1)


def test_stats_name_the_kind_and_a_writable_store_is_not_read_only(root):
    with DiskStore.from_url(f"disk://{root}") as s:
        stats = s.stats()
    assert (stats.kind, stats.read_only, stats.counts_scope) == ("disk", None, None)
