"""``block_topk``'s ``channels`` option: every key scored on its own, on a
few of its channels.

A block's mean key averages a single strong key away, and Quest's bound over
a block's keys is loose: a query that needs one token far back (a copy of
earlier text, a fact looked up) finds no block that stands out.  Scoring
every key on its own sees it, but on all channels it reads as many bytes as
the keys.  With ``channels: r`` the summaries keep, for every token, ``r``
of its key's channels: per KV head, those where the keys are largest in
magnitude (a layer's keys put much of their weight on a few channels,
whatever the text).  The query is scored against every token on those
channels, and a block's estimate adds its tokens up (in log space, as
``parts`` adds slices).

The channels are chosen once per layer, at its first call that can thin:
from the keys of a few blocks its rows read (the first ``SAMPLE_BLOCKS``
of each of the first ``SAMPLE_ROWS`` rows), read from the pages.  The
layer's summaries are made then, and that call rebuilds from the pages what
its rows read (``SummaryKeeper``'s ``catch_up``, as after calls left dense
below ``dense_below``).

Here the choice and the projection: of a call's query and keys onto the
channels, and of the pages' keys (``ChannelPages``), so that the summaries
and the selection (torch ops or the Triton kernels) run unchanged, on keys
``r`` wide with one slice per token; a slice holds one key, so the
summaries keep it in its own 16-bit dtype, exactly (``SummaryKeeper``).
Knows attention math and tensors; nothing of vLLM.
"""

from __future__ import annotations

import dataclasses

import torch

from .base import AttentionBatch, KeyPages

#: The blocks a layer's channels are chosen from: the first SAMPLE_BLOCKS
#: of each of the first SAMPLE_ROWS rows of its first call that can thin.
SAMPLE_ROWS, SAMPLE_BLOCKS = 8, 16


class ChannelPages(KeyPages):
    """A layer's pages, their keys cut down to the chosen channels.  Probes
    are the cache's own (they tell whether a page still holds the keys a
    summary was made from, whatever the summary keeps)."""

    def __init__(self, pages: KeyPages, channels: torch.Tensor) -> None:
        self._pages = pages
        self._channels = channels           # [num_kv_heads, r]

    def read(self, block_ids: torch.Tensor) -> torch.Tensor:
        keys = self._pages.read(block_ids)  # [n, block_size, H, D]
        index = self._channels.view(1, 1, *self._channels.shape).expand(*keys.shape[:2], -1, -1)
        return keys.gather(3, index)

    def probe(self, block_ids: torch.Tensor) -> torch.Tensor:
        return self._pages.probe(block_ids)

    def key_view(self):
        """The cache's own view, all channels: kernels read probes from it."""
        return self._pages.key_view()


class LayerChannels:
    """One layer's channels (``chosen`` None: not chosen yet)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.chosen: torch.Tensor | None = None        # [H, r] int64, ascending
        self.query_index: torch.Tensor | None = None   # [num_heads, r]: each query head's KV head's

    @classmethod
    def placeholder(cls, count: int, num_kv_heads: int, head_size: int, device: torch.device) -> "LayerChannels":
        """Channels chosen without keys (each KV head's first ``count``):
        calls projected with them have the shapes real ones have."""
        layer = cls(count)
        r = min(count, head_size)
        layer.chosen = torch.arange(r, device=device).expand(num_kv_heads, r).contiguous()
        return layer

    def choose(self, pages: KeyPages, table: torch.Tensor, valid: torch.Tensor) -> None:
        """Choose, per KV head, the ``count`` channels where the keys of the
        first ``SAMPLE_BLOCKS`` blocks of the first ``SAMPLE_ROWS`` rows of
        ``table`` (``[rows, width]``; ``valid``: the entries that hold a
        request's keys), read from the pages, are largest in magnitude.
        Never waits for the device."""
        blocks = table[:SAMPLE_ROWS, :SAMPLE_BLOCKS].flatten()
        valid = valid[:SAMPLE_ROWS, :SAMPLE_BLOCKS].flatten()
        keys = pages.read(blocks)                       # [n, block_size, H, D]
        magnitude = torch.where(valid.view(-1, 1, 1, 1), keys.float().abs(), 0.0).sum(dim=(0, 1))
        r = min(self.count, magnitude.shape[1])
        self.chosen = magnitude.topk(r, dim=1).indices.sort(dim=1).values

    def project(self, batch: AttentionBatch) -> AttentionBatch:
        """``batch`` on the chosen channels: its query (each head on its KV
        head's channels), its keys and its pages, ``r`` wide."""
        chosen = self.chosen
        num_heads = batch.query.shape[1]
        if self.query_index is None or self.query_index.device != chosen.device:
            self.query_index = chosen.repeat_interleave(num_heads // chosen.shape[0], dim=0)
        query = _gatherable(batch.query)
        q_index = self.query_index.unsqueeze(0).expand(query.shape[0], -1, -1)
        key = batch.key
        if key is not None:
            key = _gatherable(key).gather(2, chosen.unsqueeze(0).expand(key.shape[0], -1, -1))
        pages = ChannelPages(batch.pages, chosen) if batch.pages is not None else None
        return dataclasses.replace(batch, query=query.gather(2, q_index), key=key,
                                   head_size=chosen.shape[1], pages=pages)


def _gatherable(t: torch.Tensor) -> torch.Tensor:
    """``t``, or its values in fp32 where torch cannot gather its dtype
    (fp8: an fp8 cache's query; its scale is in the call's ``scale``)."""
    return t.float() if t.element_size() == 1 else t


class KeyChannels:
    """Every layer's channels (``channels: r``), by layer name."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._layers: dict[str, LayerChannels] = {}

    def layer(self, layer_name: str) -> LayerChannels:
        layer = self._layers.get(layer_name)
        if layer is None:
            layer = self._layers[layer_name] = LayerChannels(self.count)
        return layer
