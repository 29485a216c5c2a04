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


def test_save_layerwise_takes_auto_true_or_false():
    assert UCMConfig.from_extra_config({}).save_layerwise == "auto"
    for value in ("auto", True, False):
        assert UCMConfig.from_extra_config({"save_layerwise": value}).save_layerwise == value
    for bad in ("yes", 1, None):
        with pytest.raises(UCMConfigError, match=f"save_layerwise: expected auto, true or false, got {bad!r}"):
            UCMConfig.from_extra_config({"save_layerwise": bad})


def test_a_config_file_that_is_not_utf8_is_named_with_the_fix(tmp_path):
    path = tmp_path / "ucm.yaml"
    path.write_bytes("store: disk:///tmp/caf\u00e9\n".encode("latin-1"))
    with pytest.raises(UCMConfigError) as info:
        UCMConfig.from_extra_config({"config_file": str(path)})
    message = str(info.value)
    assert f"config_file {str(path)!r}" in message
    assert "not UTF-8" in message and "line 1" in message and "save it as UTF-8" in message


def test_a_config_file_with_a_utf8_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "ucm.yaml"
    path.write_bytes(b"\xef\xbb\xbfmin_hit_blocks: 3\n")
    assert UCMConfig.from_extra_config({"config_file": str(path)}).min_hit_blocks == 3


def test_an_oversized_max_pending_save_mib_is_refused_with_the_limit():
    with pytest.raises(UCMConfigError) as info:
        UCMConfig.from_extra_config({"max_pending_save_mib": 10**23})
    assert "max_pending_save_mib" in str(info.value) and "1048576" in str(info.value)
    assert UCMConfig.from_extra_config({"max_pending_save_mib": 1 << 20}).max_pending_save_mib == 1 << 20


def test_ucm_config_check_names_a_config_file_that_is_not_utf8(tmp_path, capsys):
    from ucm_connector.cli import main

    path = tmp_path / "ucm.yaml"
    path.write_bytes(b"store: disk:///tmp/x\n# \xff\xfe\n")
    assert main(["config", "check", "--no-connect", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ucm: ") and "not UTF-8" in err and "line 2" in err


def test_a_yaml_error_quoting_a_store_url_does_not_show_its_password(tmp_path):
    path = tmp_path / "ucm.yaml"
    path.write_text("min_hit_blocks: 2\nstore: redis://:s3cret@127.0.0.1:1/0: x\n")
    with pytest.raises(UCMConfigError) as info:
        UCMConfig.from_extra_config({"config_file": str(path)})
    message = str(info.value)
    assert "not valid YAML" in message and "line 2" in message and "127.0.0.1:1/0" in message
    assert "s3cret" not in message


def test_every_option_is_a_config_field_with_the_tables_default():
    import dataclasses

    from ucm_connector.config import OPTIONS, UCMConfig

    fields = {f.name: f for f in dataclasses.fields(UCMConfig)}
    assert set(fields) == {o.name for o in OPTIONS}
    for option in OPTIONS:
        if option.name != "store":   # required; its default is resolved at parse time
            assert fields[option.name].default == option.default, option.name
