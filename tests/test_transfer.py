"""Whole-block gather/scatter between paged caches and contiguous buffers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ucm_connector.transfer import BlockTransfer


def _caches(shape, layers=3, dtype=torch.bfloat16):
    torch.manual_seed(0)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(*shape).to(dtype) for i in range(layers)}


def test_block_major_pages_round_trip_byte_for_byte():
    src = _caches((10, 2, 32, 16))
    transfer = BlockTransfer(src, num_blocks=10)
    assert transfer.payload_nbytes == 3 * 2 * 32 * 16 * 2
    out = np.zeros((2, transfer.payload_nbytes), dtype=np.uint8)
    transfer.gather([3, 7], out)
    expected = b"".join(t[3].view(torch.uint8).numpy().tobytes() for t in src.values())
    assert out[0].tobytes() == expected

    dst = {name: torch.zeros_like(t) for name, t in src.items()}
    BlockTransfer(dst, num_blocks=10).scatter([1, 2], out)
    for name in src:
        assert torch.equal(dst[name][1].view(torch.uint8), src[name][3].view(torch.uint8))
        assert torch.equal(dst[name][2].view(torch.uint8), src[name][7].view(torch.uint8))
        assert not dst[name][0].view(torch.uint8).any()  # other pages untouched


def test_kv_first_layout_takes_both_halves_of_a_page():
    src = _caches((2, 10, 32, 4, 16), layers=2, dtype=torch.float16)
    transfer = BlockTransfer(src, num_blocks=10)
    out = np.zeros((1, transfer.payload_nbytes), dtype=np.uint8)
    transfer.gather([4], out)
    expected = b"".join(t[0, 4].numpy().tobytes() + t[1, 4].numpy().tobytes() for t in src.values())
    assert out[0].tobytes() == expected


def test_an_unknown_layout_is_refused_with_the_layer_named():
    with pytest.raises(ValueError, match="model.layers.0.self_attn.attn"):
        BlockTransfer(_caches((7, 2, 32, 16), layers=1), num_blocks=10)
