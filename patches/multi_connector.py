"""``MultiConnector.__init__``: settle the load-failure policy vLLM reads.

vLLM's scheduler reads ``kv_load_failure_policy`` from the top-level
transfer config.  Under ``MultiConnector`` each child gets a config of its
own, built from its entry alone, so UCMConnector as a child cannot see the
policy that applies.  This patch hands the top-level config to
``ucm_connector.connector.settle_load_failure_policy`` once the children
exist, when one of them is a UCMConnector; everything else is vLLM's own.
"""

from __future__ import annotations

from typing import Any, Callable

from ._core import Patch


def _make_init(original: Callable) -> Callable:
    def __init__(self, vllm_config, role, kv_cache_config=None, *args: Any, **kwargs: Any) -> None:
        original(self, vllm_config, role, kv_cache_config, *args, **kwargs)
        from ucm_connector.connector import UCMConnector, settle_load_failure_policy

        if any(isinstance(child, UCMConnector) for child in getattr(self, "_connectors", ())):
            settle_load_failure_policy(vllm_config.kv_transfer_config)

    return __init__


def _check(owner: Any) -> list[str]:
    from vllm.config.kv_transfer import KVTransferConfig

    problems = []
    if "kv_load_failure_policy" not in getattr(KVTransferConfig, "__dataclass_fields__", {}):
        problems.append("KVTransferConfig has no field 'kv_load_failure_policy'")
    return problems


MULTI_CONNECTOR_INIT = Patch(
    name="multi_connector.init",
    module="vllm.distributed.kv_transfer.kv_connector.v1.multi_connector",
    owner="MultiConnector",
    attr="__init__",
    params=("self", "vllm_config", "role", "kv_cache_config"),
    make=_make_init,
    check_more=_check,
)
