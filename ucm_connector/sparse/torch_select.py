"""``block_topk``'s selection in torch ops: on the CPU, on CUDA without
Triton, and wherever a step has to read blocks without a summary.

Owns scoring every block of every row against the row's query (``scores``:
the share of attention each block is estimated to take, from the slices'
mean keys or from Quest's bound) and choosing the budget's best blocks per
thinned row, sinks and the local window forced in, in position order
(``select``).  ``triton_select.py`` computes the same, in two kernels.

What it must not do: wait for the device on the usual path (every shape
comes from the ``StepPlan``; rows that are not thinned are put back with
``where``), change summaries, or decide which calls are thinned.
"""

from __future__ import annotations

import functools

import torch

from .base import AttentionBatch, BlockSelection
from .summaries import LayerSummaries
from .topk_plan import STATS, StepPlan

_BLOCKS_READ = STATS.index("blocks_read")


def select(layer: LayerSummaries, batch: AttentionBatch, plan: StepPlan, score: str,
           unsummarized: torch.Tensor | None, totals: torch.Tensor) -> tuple[BlockSelection, torch.Tensor]:
    """The selection of this layer call, and the positions it chose per
    row, ascending, ``plan.width`` past a row's budget (``[rows, k]``);
    ``unsummarized``: the (row, position) entries without a summary, or
    None."""
    t = plan.tensors(batch)
    table, seq_lens = plan.outputs(batch)
    forced = t.forced if unsummarized is None else t.forced | unsummarized
    # A NaN share (keys that were NaN; a row whose every logit was -inf)
    # must not outrank the forced blocks: topk ranks NaN above inf.
    block_scores = _no_nan(scores(layer, batch, plan, score)).masked_fill(forced, float("inf"))
    # Positions past a row's blocks never win, even over blocks whose
    # share underflowed to zero.
    block_scores.masked_fill_(t.invalid, float("-inf"))
    k, keep, in_budget = plan.keep_max, t.keep, t.in_budget
    if unsummarized is not None:
        # Blocks with no summary are read on top of the budget (this path
        # waits for the device anyway: see SummaryKeeper.refresh_stale).
        keep = torch.where(t.thin, torch.maximum(t.keep, forced.sum(dim=1)), t.keep)
        k = int(torch.where(t.thin, keep, 0).max())
        in_budget = torch.arange(k, device=keep.device).unsqueeze(0) < keep.unsqueeze(1)
        seq_lens = torch.where(t.thin, (keep - 1) * batch.block_size + t.last_fill,
                               batch.seq_lens).to(batch.seq_lens.dtype)
        totals[_BLOCKS_READ] += ((keep - t.keep) * t.thin).sum()
    top = block_scores.topk(k, dim=1).indices
    top = torch.where(in_budget, top, plan.width)
    positions = top.sort(dim=1).values
    num_rows = plan.num_rows
    blocks = t.table.gather(1, positions.clamp(max=plan.width - 1)).to(table.dtype)
    table[:num_rows, :k] = torch.where(t.thin.unsqueeze(1), blocks, batch.block_table[:num_rows, :k])
    plan.count_call(batch)
    return BlockSelection(block_table=table, seq_lens=seq_lens), positions


def scores(layer: LayerSummaries, batch: AttentionBatch, plan: StepPlan, score: str) -> torch.Tensor:
    """Estimated share of each block in the attention of each row's
    query, ``[rows, width]`` (every row: the caller keeps what it needs)."""
    t = plan.tensors(batch)
    num_rows = plan.num_rows
    q = batch.query[:num_rows] if plan.decode_only else batch.query.index_select(0, t.q_index)
    n, num_heads, d = q.shape
    h, width = batch.num_kv_heads, plan.width
    q = q.float().reshape(n * h, num_heads // h, d)
    if score == "bound":
        summaries = layer.minmax.view(-1, 2 * d).index_select(0, t.head_index).view(n * h, width, 2 * d)
        q = torch.cat((q.clamp(min=0), q.clamp(max=0)), dim=-1)
        logits = torch.bmm(q, summaries.transpose(1, 2)).view(n, num_heads, width).mul_(batch.scale)
        # A block whose summary bounds no key (min +inf, max -inf) scores
        # 0 * inf = NaN in the channels where the query is 0 or of the other
        # sign; so does one whose keys were NaN, in either score: such a
        # block is worth nothing, rather than turning the whole row's
        # softmax into NaN.
        _no_nan(logits).masked_fill_(t.invalid_by_head, float("-inf"))
    else:
        parts = layer.parts
        # Slices of one token (``channels``) hold one key: each one's
        # factor is the scale, applied to the query before the matmul.
        one_key = layer.part_size == 1
        if one_key:
            q = q * batch.scale
        index = t.part_index(parts, h)
        summaries = _take_rows(layer.part_sum.view(-1, d), index).view(n * h, width * parts, d)
        if summaries.dtype != q.dtype and _multiplies(summaries):
            # 16-bit summaries (keys kept as they are: ``channels``): the
            # matmul in their dtype (fp32 accumulation, its output rounded to
            # it), the rest in fp32.
            logits = torch.bmm(q.to(summaries.dtype), summaries.transpose(1, 2))
        else:
            logits = torch.bmm(q, summaries.transpose(1, 2).float())
        logits = logits.view(n, num_heads, width, parts)
        # A block's mass ~ sum over its slices of count * exp(scale * q . mean).
        factor, log_count = t.slice_weights(parts, batch.scale)
        if not one_key:
            logits.mul_(factor)
        logits = logits.add_(log_count) if logits.dtype == log_count.dtype else logits + log_count
        _no_nan(logits)
        if parts > 1:
            # Each block's share is its slices' shares summed: the softmax
            # over every slice of the row, which is the softmax of the
            # blocks' log-sum-exps in fewer passes.
            shares = logits.view(n, num_heads, width * parts).softmax(dim=-1)
            return shares.view(n, num_heads, width, parts).sum(dim=-1).mean(dim=1)
        logits = logits.squeeze(-1)
    return logits.softmax(dim=-1).mean(dim=1)


def _no_nan(t: torch.Tensor) -> torch.Tensor:
    """``t`` with NaN made -inf (infinities kept), in place."""
    return t.nan_to_num_(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))


def _take_rows(flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``flat.index_select(0, index)``, rows moved as 4-byte words where
    they are of 16-bit floats (torch's gather of those is 2-3x slower on
    CPU than of the same bytes as int32)."""
    if flat.element_size() == 2 and flat.shape[1] % 2 == 0:
        return flat.view(torch.int32).index_select(0, index).view(flat.dtype)
    return flat.index_select(0, index)


def _multiplies(t: torch.Tensor) -> bool:
    """Whether a matmul in ``t``'s 16-bit dtype is fast on its device: on
    a GPU, and on a CPU with bf16 dot-product instructions (AVX512-BF16 or
    AMX) for bf16.  Elsewhere it is converted to fp32 first: on an AVX2 CPU
    a bf16 matmul of a decode call's summaries took 6-8x the time of an
    fp32 one, conversion included."""
    if t.device.type != "cpu":
        return True
    return t.dtype == torch.bfloat16 and _cpu_has_bf16_dot()


@functools.cache
def _cpu_has_bf16_dot() -> bool:
    probes = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(probe is not None and probe() for probe in probes)
