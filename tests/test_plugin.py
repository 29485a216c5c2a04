"""The vllm.general_plugins entry point registers UCMConnector by name."""

from __future__ import annotations

import importlib.metadata


def test_the_entry_point_is_declared():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.value == "ucm_connector.plugin:register" for ep in eps)


def test_vllm_resolves_the_name_through_its_plugin_loader():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    config = KVTransferConfig(kv_connector="UCMConnector", kv_role="kv_both")
    cls = KVConnectorFactory.get_connector_class(config)
    assert cls.__module__ == "ucm_connector.connector" and cls.__name__ == "UCMConnector"


def test_registering_twice_is_harmless():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from ucm_connector.plugin import register

    register()
    register()
    config = KVTransferConfig(kv_connector="UCMConnector", kv_role="kv_both")
    cls = KVConnectorFactory.get_connector_class(config)
    assert cls.__module__ == "ucm_connector.connector" and cls.__name__ == "UCMConnector"


def test_the_module_path_form_resolves_the_same_class():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    config = KVTransferConfig(kv_connector="UCMConnector", kv_role="kv_both",
                              kv_connector_module_path="ucm_connector.connector")
    cls = KVConnectorFactory.get_connector_class(config)
    assert cls.__name__ == "UCMConnector"
