"""The ``vllm.general_plugins`` entry point: makes ``"kv_connector":
"UCMConnector"`` work without ``kv_connector_module_path``.

vLLM loads general plugins in every process it starts (frontend, engine
core, each worker), so registering must be cheap and harmless to repeat.
"""

from __future__ import annotations

CONNECTOR_NAME = "UCMConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = getattr(KVConnectorFactory, "_registry", {})
    if CONNECTOR_NAME in registry:
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "ucm_connector.connector", "UCMConnector")
    except ValueError:
        # Another thread of this process registered it first.
        pass
