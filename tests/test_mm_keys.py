"""Multimodal inputs in block keys: a request shares KV only when each of its
inputs is named by what it is.  vLLM names an input by a hash of its content,
except with both of its caches off, where it takes a per-process counter; the
connector must then keep such requests out of the store, or two engines'
first images would share KV (another user's image, the wrong tokens)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from store_backends import open_store
from ucm_connector.connector import mm_named_by_content
from ucm_connector.counters import StatsCollector
from ucm_connector.hashing import BlockHasher, Namespace
from ucm_connector.scheduler import UCMScheduler


def _scheduler(tmp_path, **kwargs) -> UCMScheduler:
    ns = Namespace(model_fingerprint="a" * 32, dtype="bfloat16", kv_layout="cpu/CPU_ATTN/vec/auto", block_size=16,
                   num_layers=2, num_kv_heads=1, head_size=8, tp_rank=0, tp_size=1)
    return UCMScheduler(store=open_store(f"disk://{tmp_path}/s"), hasher=BlockHasher(ns), block_size=16, tp_size=1,
                        load=True, save=True, min_hit_blocks=1, stats=StatsCollector(), **kwargs)


def _image(identifier, offset, length=8):
    position = None if offset is None else SimpleNamespace(offset=offset, length=length)
    return SimpleNamespace(identifier=identifier, mm_hash=None, mm_position=position)


def _request(req_id, images, n=64):
    return SimpleNamespace(request_id=req_id, all_token_ids=list(range(100, 100 + n)), mm_features=images,
                           prompt_embeds=None, lora_request=None, cache_salt=None)


def _keys(scheduler, request):
    return scheduler._keys(scheduler._state(request))


def test_inputs_added_to_a_running_request_enter_its_keys(tmp_path):
    """A streaming session adds the next turn's tokens and images to the
    same request: the keys of the blocks after it are made with the new
    images (two sessions alike but for the second image must not share
    them), and the blocks before keep theirs."""
    scheduler = _scheduler(tmp_path)
    session = _request("s", [_image("img-1", 2)], n=32)
    first_turn = _keys(scheduler, session)
    session.all_token_ids = list(range(100, 164))
    session.mm_features = session.mm_features + [_image("img-2", 40)]
    keys = _keys(scheduler, session)
    assert keys[:2] == first_turn
    assert keys == _keys(scheduler, _request("whole", [_image("img-1", 2), _image("img-2", 40)]))
    assert keys[2:] != _keys(scheduler, _request("other", [_image("img-1", 2), _image("img-3", 40)]))[2:]
    scheduler.store.close()


@pytest.mark.parametrize("image", [_image(None, 2), _image("img-1", None)], ids=["no identifier", "no place"])
def test_an_input_the_keys_cannot_name_leaves_its_request_unkeyed(tmp_path, image):
    """Keyed without that input, the request would share KV with the same
    tokens around another image."""
    scheduler = _scheduler(tmp_path)
    assert _keys(scheduler, _request("r", [_image("img-0", 20), image])) == []
    assert len(_keys(scheduler, _request("named", [_image("img-0", 20)]))) == 4
    scheduler.store.close()


def test_an_engine_naming_inputs_by_a_counter_keys_only_text_requests(tmp_path):
    scheduler = _scheduler(tmp_path, mm_by_content=False)
    request = _request("r", [_image("renderer0-mm-1-image-0", 2)])
    assert _keys(scheduler, request) == []
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    assert len(_keys(scheduler, _request("text", []))) == 4
    scheduler.store.close()


def _config(cache_gb, prefix_caching):
    return SimpleNamespace(
        model_config=SimpleNamespace(multimodal_config=SimpleNamespace(mm_processor_cache_gb=cache_gb)),
        cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching))


class _Items(dict):
    def get_all_counts(self):
        return {modality: len(items) for modality, items in self.items()}


@pytest.mark.parametrize("cache_gb, prefix_caching", [(0, False), (0, True), (4, False), (4, True)])
def test_the_rule_matches_where_vllm_names_inputs_by_a_counter(cache_gb, prefix_caching):
    """vLLM's renderer, run on the same settings: where it names an image by
    its request counter, ``mm_named_by_content`` says so."""
    from vllm.renderers.base import BaseRenderer

    config = _config(cache_gb, prefix_caching)
    renderer = SimpleNamespace(model_config=config.model_config, config=config,
                               _validate_mm_uuids=lambda *args: None)
    uuids = BaseRenderer._process_mm_uuids(renderer, {"image": [b"pixels"]}, _Items(image=[b"pixels"]), {},
                                           "renderer0-mm-1")
    by_counter = any(u is not None and u.startswith("renderer0-mm-1") for u in uuids.get("image", ()))
    assert mm_named_by_content(config) is not by_counter
    assert by_counter is (cache_gb == 0 and not prefix_caching)


def test_a_text_only_model_is_keyed_as_before():
    config = SimpleNamespace(model_config=SimpleNamespace(multimodal_config=None),
                             cache_config=SimpleNamespace(enable_prefix_caching=False))
    assert mm_named_by_content(config) is True
