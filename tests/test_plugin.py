"""The vllm.general_plugins entry point registers UCMConnector by name."""

from __future__ import annotations

import importlib.metadata

import pytest


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


def test_layerwise_loads_and_sparse_attention_ask_vllm_for_piecewise_cuda_graphs(tmp_path):
    """vLLM (0.33 on) asks the connector's class, with the extra config,
    before it settles its CUDA graph mode, the way its config does it: the
    factory's class, then the classmethod.  A config file counts; a bad
    config answers False (the constructor reports it)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from ucm_connector.plugin import register

    register()

    def asks(extra):
        config = KVTransferConfig(kv_connector="UCMConnector", kv_role="kv_both", kv_connector_extra_config=extra)
        return KVConnectorFactory.get_connector_class(config).requires_piecewise_for_cudagraph(
            config.kv_connector_extra_config)

    from_file = tmp_path / "ucm.yaml"
    from_file.write_text("load_layerwise: true\n")
    assert asks({"load_layerwise": True}) is True
    assert asks({"sparse": {"method": "block_topk", "keep_ratio": 0.25}}) is True
    assert asks({"config_file": str(from_file)}) is True
    assert asks({}) is False
    assert asks({"save_layerwise": True}) is False     # a replay's layers are copied after the pass
    assert asks({"load_kv_async": True}) is False
    assert asks({"load_layerwise": "sometimes"}) is False


def test_with_full_cuda_graphs_layerwise_loads_load_before_the_step_and_sparse_refuses(monkeypatch, caplog):
    """On CUDA, an engine that replays full CUDA graphs (a vLLM that never
    asked, or a mode set afterwards) skips the layer waits: layer-by-layer
    loads become loads before the step, with a warning that says what to
    set; sparse attention refuses to start.  Piecewise graphs, eager mode
    and the CPU keep the configured way."""
    from types import SimpleNamespace

    from vllm.config.compilation import CUDAGraphMode
    from vllm.platforms import current_platform

    from ucm_connector.config import LoadMode, UCMConfig
    from ucm_connector.connector import engine_load_mode
    from ucm_connector.plugin import _refuse_full_cuda_graphs

    def engine(mode):
        return SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=mode))

    layerwise = UCMConfig.from_extra_config({"load_layerwise": True})
    full = engine(CUDAGraphMode.FULL_AND_PIECEWISE)
    assert engine_load_mode(layerwise, full) is LoadMode.LAYER          # this CPU
    _refuse_full_cuda_graphs(full)

    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    for mode in (CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY):
        caplog.clear()
        assert engine_load_mode(layerwise, engine(mode)) is LoadMode.SYNC
        assert f"cudagraph_mode {mode.name}" in caplog.text and '"cudagraph_mode": "PIECEWISE"' in caplog.text
        with pytest.raises(RuntimeError, match="outside CUDA graphs"):
            _refuse_full_cuda_graphs(engine(mode))
    for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE):
        assert engine_load_mode(layerwise, engine(mode)) is LoadMode.LAYER
        _refuse_full_cuda_graphs(engine(mode))
    assert engine_load_mode(UCMConfig.from_extra_config({"load_kv_async": True}), full) is LoadMode.ASYNC
    assert engine_load_mode(UCMConfig.from_extra_config({}), full) is LoadMode.SYNC


def test_under_async_scheduling_every_load_is_async_and_load_layerwise_is_told_to_go(monkeypatch, caplog):
    """Async scheduling makes every configured way of loading asynchronous;
    asked for ``load_layerwise``, the warning says that vLLM still gave up
    its full CUDA graphs for it (it asks the connector with the options
    alone), even after a sync engine of the same process logged its
    own line."""
    from types import SimpleNamespace

    from vllm.config.compilation import CUDAGraphMode

    from ucm_connector import connector
    from ucm_connector.config import LoadMode, UCMConfig

    monkeypatch.setattr(connector, "_logged", set())
    engine = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=True),
                             compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode.PIECEWISE))
    with caplog.at_level("INFO", logger=connector.logger.name):
        assert connector.engine_load_mode(UCMConfig.from_extra_config({}), engine) is LoadMode.ASYNC
        assert "loading hits on the loader thread" in caplog.text and "piecewise" not in caplog.text
        caplog.clear()
        layerwise = UCMConfig.from_extra_config({"load_layerwise": True})
        assert connector.engine_load_mode(layerwise, engine) is LoadMode.ASYNC
    assert "not layer by layer" in caplog.text and "drop it to keep full ones" in caplog.text
    assert caplog.records[-1].levelname == "WARNING"
    # With sparse attention the graphs stay piecewise whatever the loads do.
    monkeypatch.setattr(connector, "_logged", set())
    caplog.clear()
    with caplog.at_level("INFO", logger=connector.logger.name):
        sparse = UCMConfig.from_extra_config({"load_layerwise": True, "sparse": {"method": "block_topk"}})
        assert connector.engine_load_mode(sparse, engine) is LoadMode.ASYNC
    assert "not layer by layer" in caplog.text and "drop it" not in caplog.text


def test_pipeline_and_context_parallelism_are_refused_at_start_up(tmp_path):
    """Blocks are keyed per tensor-parallel rank only: a pipeline stage
    would load another stage's layers under the same keys, and context
    parallelism splits a block's tokens across ranks.  The connector
    refuses to start, naming the setting."""
    import os
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from ucm_connector.connector import UCMConnector, _refuse_unsupported_parallelism

    model = os.path.join(os.path.dirname(os.path.dirname(__file__)), "models", "tiny-llama")
    config = EngineArgs(model=model, pipeline_parallel_size=2, max_model_len=512, distributed_executor_backend="mp",
                        kv_transfer_config={"kv_connector": "UCMConnector", "kv_role": "kv_both",
                                            "kv_connector_extra_config": {"store": f"disk://{tmp_path}/s"}},
                        ).create_engine_config()
    with pytest.raises(RuntimeError, match="pipeline_parallel_size 2 is not supported"):
        UCMConnector(config, KVConnectorRole.SCHEDULER)
    with pytest.raises(RuntimeError, match="decode_context_parallel_size 2 is not supported"):
        _refuse_unsupported_parallelism(SimpleNamespace(pipeline_parallel_size=1, decode_context_parallel_size=2))
    _refuse_unsupported_parallelism(SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=4))


def test_the_sparse_method_is_told_how_many_drafts_a_speculative_engine_verifies():
    from types import SimpleNamespace

    from ucm_connector.plugin import _tell_of_speculation
    from ucm_connector.sparse import build_method

    method = build_method({"method": "block_topk", "keep_ratio": 0.25})
    assert _tell_of_speculation(method, SimpleNamespace(speculative_config=None)) == 0
    assert method._query_tokens == 1
    engine = SimpleNamespace(speculative_config=SimpleNamespace(method="ngram", num_speculative_tokens=3))
    assert _tell_of_speculation(method, engine) == 3
    assert method._query_tokens == 4


def test_applying_the_same_sparse_option_again_tells_the_kept_method_of_the_engines_drafts():
    """The connector applies the option again where a method is active (a
    second engine in the process): the method is kept, and what it is told
    follows the engine, both ways."""
    from types import SimpleNamespace

    import patches
    from ucm_connector.plugin import apply_sparse

    option = {"method": "block_topk", "keep_ratio": 0.25}
    plain = SimpleNamespace(speculative_config=None, compilation_config=None)
    speculative = SimpleNamespace(speculative_config=SimpleNamespace(method="ngram", num_speculative_tokens=3),
                                  compilation_config=None)
    patches.revert()
    try:
        method = apply_sparse(option)
        assert method._query_tokens == 1
        assert apply_sparse(option, speculative) is method and method._query_tokens == 4
        assert apply_sparse(option, plain) is method and method._query_tokens == 1
    finally:
        patches.revert()


def test_save_layerwise_is_off_with_microbatches(caplog):
    """Under --enable-dbo (or ubatch_size above 1) each microbatch reports a
    layer when its own attention is done: a layer's gather at the first
    report would copy pages the other microbatch has not written yet."""
    from types import SimpleNamespace

    from vllm.config import ParallelConfig

    from ucm_connector.config import UCMConfig
    from ucm_connector import connector
    from ucm_connector.connector import layerwise_saves

    connector._logged.discard("dbo")        # said once per process
    asked = UCMConfig.from_extra_config({"save_layerwise": True})

    def engine(dbo=False, ubatch_size=1):
        return SimpleNamespace(parallel_config=ParallelConfig(enable_dbo=dbo, ubatch_size=ubatch_size))

    assert layerwise_saves(asked, engine()) is True
    # The default (auto) leaves it to the worker (on CUDA, not on CPU), and
    # with microbatches is off without a word: nobody asked for it.
    default = UCMConfig.from_extra_config({})
    assert default.save_layerwise == "auto"
    assert layerwise_saves(default, engine()) is None
    assert layerwise_saves(default, engine(dbo=True)) is False
    assert "save_layerwise" not in caplog.text
    assert layerwise_saves(UCMConfig.from_extra_config({"save_layerwise": False}), engine()) is False
    assert layerwise_saves(asked, engine(dbo=True)) is False
    assert "save_layerwise does not work with microbatches" in caplog.text
    assert layerwise_saves(asked, engine(ubatch_size=2)) is False
