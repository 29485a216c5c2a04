"""kv_connector_extra_config and config_file parsed into UCMConfig."""

from __future__ import annotations

import pytest

from ucm_connector.config import OPTIONS, UCMConfig, UCMConfigError, default_store_url


def test_defaults_need_no_server():
    config = UCMConfig.from_extra_config({})
    assert config.store == default_store_url()
    assert config.store.startswith("disk:///")
    assert config.sparse is None and config.tier_write_mode == "async"


def test_a_list_of_urls_is_a_tier():
    config = UCMConfig.from_extra_config({"store": ["shm://a", "disk:///tmp/x"]})
    assert config.store_urls == ["shm://a", "disk:///tmp/x"]


def test_an_unknown_key_is_named_with_a_suggestion():
    with pytest.raises(UCMConfigError, match=r"unknown key 'stor' \(did you mean 'store'\?\)"):
        UCMConfig.from_extra_config({"stor": "disk:///x"})


@pytest.mark.parametrize("key, value, message", [
    ("store", "nonsense", "store: store 'nonsense' is not a URL"),
    ("store", [], "store: expected a store URL or a non-empty list"),
    ("store", 5, "store: expected a store URL"),
    ("tier_write_mode", "later", "tier_write_mode: expected one of async, sync, got 'later'"),
    ("min_hit_blocks", 0, "min_hit_blocks: expected a positive integer, got 0"),
    ("max_pending_save_mib", True, "max_pending_save_mib: expected a positive integer"),
    ("sparse", {"method": "topk"}, "sparse: no sparse-attention method named 'topk'"),
    ("sparse", "topk", "sparse: expected {\"method\": NAME"),
])
def test_bad_values_are_named(key, value, message):
    with pytest.raises(UCMConfigError) as info:
        UCMConfig.from_extra_config({key: value})
    assert message in str(info.value)


def test_config_file_is_merged_and_extra_config_wins(tmp_path):
    path = tmp_path / "ucm.yaml"
    path.write_text("store: redis://127.0.0.1:6379/0\nmin_hit_blocks: 3\n")
    config = UCMConfig.from_extra_config({"config_file": str(path), "min_hit_blocks": 2})
    assert config.store == "redis://127.0.0.1:6379/0"
    assert config.min_hit_blocks == 2


def test_config_file_errors_name_the_file_and_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("stores: disk:///x\n")
    with pytest.raises(UCMConfigError, match=r"config_file '.*bad.yaml': unknown key 'stores'"):
        UCMConfig.from_extra_config({"config_file": str(bad)})
    with pytest.raises(UCMConfigError, match="cannot be read"):
        UCMConfig.from_extra_config({"config_file": str(tmp_path / "missing.yaml")})
    broken = tmp_path / "broken.yaml"
    broken.write_text("store: [unclosed\n")
    with pytest.raises(UCMConfigError, match="not valid YAML"):
        UCMConfig.from_extra_config({"config_file": str(broken)})


def test_every_option_has_a_field_and_help():
    fields = set(UCMConfig.__dataclass_fields__)
    for option in OPTIONS:
        assert option.name in fields
        assert option.help
    assert fields == {o.name for o in OPTIONS}


def test_load_mode_follows_the_two_load_options():
    assert UCMConfig.from_extra_config({}).load_mode == "sync"
    assert UCMConfig.from_extra_config({"load_kv_async": True}).load_mode == "async"
    assert UCMConfig.from_extra_config({"load_layerwise": True}).load_mode == "layer"
    with pytest.raises(UCMConfigError, match="load_kv_async: expected true or false, got 'yes'"):
        UCMConfig.from_extra_config({"load_kv_async": "yes"})
    with pytest.raises(UCMConfigError, match="load_kv_async and load_layerwise: choose one"):
        UCMConfig.from_extra_config({"load_kv_async": True, "load_layerwise": True})
