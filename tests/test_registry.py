"""Opening stores by URL: schemes, third-party entry points, bad URLs."""

from __future__ import annotations

import pytest

import store_backends
from store_backends import StoreOpenError, open_store
from store_backends.registry import url_scheme
from store_backends.tiered import TieredStore
from store_backends.urls import mask_password, parse_size, query_options


def test_a_third_party_scheme_opens_through_its_entry_point(thirdparty_entry_point):
    assert "memdict" in store_backends.known_schemes()
    store = open_store("memdict://plugin_test")
    assert type(store).__name__ == "MemDictStore"
    assert type(store).__module__ == "thirdparty_store"
    store.put([b"k"], [b"v"])
    assert open_store("memdict://plugin_test").get([b"k"]) == [b"v"]


def test_a_third_party_store_takes_part_in_a_tier(thirdparty_entry_point, tmp_path):
    tier = open_store(["memdict://tier_top", f"disk://{tmp_path}/d"], write_mode="sync")
    try:
        assert isinstance(tier, TieredStore)
        tier.put([b"k"], [b"value"])
        assert open_store("memdict://tier_top").get([b"k"]) == [b"value"]
        assert open_store(f"disk://{tmp_path}/d").get([b"k"]) == [b"value"]
    finally:
        tier.close()


def test_third_party_open_errors_reach_the_caller(thirdparty_entry_point):
    with pytest.raises(StoreOpenError, match="identifier"):
        open_store("memdict://not-an-identifier")


@pytest.mark.parametrize("url, what", [
    ("ftp://host/x", "unknown scheme 'ftp'"),
    ("nonsense", "is not a URL"),
    ("://x", "is not a URL"),
    ("disk:relative/path", "is not a URL"),
])
def test_bad_urls_are_refused_with_the_url_named(url, what):
    with pytest.raises(StoreOpenError) as info:
        open_store(url)
    assert url in str(info.value)
    assert what in str(info.value)


def test_unknown_scheme_lists_the_known_ones():
    with pytest.raises(StoreOpenError, match="known schemes: .*disk.*shm"):
        open_store("nosuch://x")


def test_non_string_url_is_refused():
    with pytest.raises(StoreOpenError, match="must be a string"):
        url_scheme(42)  # type: ignore[arg-type]


def test_empty_tier_is_refused():
    with pytest.raises(StoreOpenError, match="empty list"):
        open_store([])


def test_passwords_are_masked():
    assert mask_password("redis://user:secret@h:1/0") == "redis://user:***@h:1/0"
    assert mask_password("redis://:secret@h:1/0") == "redis://:***@h:1/0"
    assert mask_password("disk:///x") == "disk:///x"


@pytest.mark.parametrize("text, nbytes", [
    ("1048576", 1 << 20), ("4GiB", 4 << 30), ("512MiB", 512 << 20), ("2GB", 2 * 10**9),
    ("1.5KiB", 1536), ("64k", 64000),
])
def test_sizes_parse(text, nbytes):
    assert parse_size(text) == nbytes


def test_a_bad_size_names_the_option_and_url():
    with pytest.raises(StoreOpenError, match=r"store 'disk:///x\?capacity=lots': capacity='lots' is not a size"):
        parse_size("lots", url="disk:///x?capacity=lots")


def test_unknown_or_repeated_options_are_named():
    with pytest.raises(StoreOpenError, match="unknown option 'capacty'"):
        query_options("disk:///x?capacty=1GiB", {"capacity"})
    with pytest.raises(StoreOpenError, match="'capacity' is given twice"):
        query_options("disk:///x?capacity=1&capacity=2", {"capacity"})
