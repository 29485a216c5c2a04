"""``block_topk``'s reuse of a choice of blocks over decode steps
(``reselect_every``): at a step in between, a layer call scores nothing;
each row reads the blocks it read at the previous step, plus its new last
block if it has just started one.

Owns each layer's last choice (``Choice``: the positions chosen per row,
ascending, how many, each row's block count and last block id, which rows
it thinned, the step it was made at and how many steps it has served),
keeping a fresh choice (the positions the torch path chose, or what the
Triton selection kernel wrote beside the table), and the reuse itself, in
torch ops or in one Triton kernel (``triton_select.reuse``).

A row reuses only a choice that still describes it: it was thinned at the
previous step and would be thinned now, it has as many blocks as then or one
more, and its table still holds, where its last block was, that block.  A
row that now holds another request fails that check unless that request
shares that block, and with it every block before it (vLLM shares a block
only between prompts whose tokens up to it are equal, so their KV is the
same).  Any other row is read whole at that step: dense attention is always
right, only slower.  Whatever the check says, a row reads only blocks of its
own table: a reused choice is positions, not block ids.

What it must not do: wait for the device (every shape comes from host-side
facts: rows, the longest row's block count, the previous choice's width),
score blocks, or change summaries.
"""

from __future__ import annotations

import dataclasses

import torch

from . import triton_select
from .base import AttentionBatch, BlockSelection
from .topk_plan import STATS, RowTensors, StepPlan, increment

_SPARSE_ROWS, _BLOCKS_READ, _ROWS_REUSED = (STATS.index(name) for name in ("sparse_rows", "blocks_read", "rows_reused"))


@dataclasses.dataclass
class Choice:
    """One layer's choice of blocks for the rows of one step."""

    serial: int                  # the step it was made at (KeptChoices' count of steps)
    age: int                     # steps it has served after the one that scored it
    positions: torch.Tensor      # [rows, k] int64, ascending in the first ``count`` columns of thinned rows
    count: torch.Tensor          # [rows] int64, blocks chosen
    num_blocks: torch.Tensor     # [rows] int64, the row's blocks then
    last_ids: torch.Tensor       # [rows] int64, the id of the row's last block then
    thin: torch.Tensor           # [rows] bool, rows it thinned


class KeptChoices:
    """Every layer's last choice, and whether a layer call may reuse it.

    A row is known again by the id of the block its choice read last (the
    row's last block then, always read): vLLM shares a block between rows
    only together with every block before it, so a row whose table holds
    that id at that position holds the same blocks at every position the
    choice read.
    """

    def __init__(self, every: int) -> None:
        self.every = every
        self._choices: dict[str, Choice] = {}
        self._serial = 0
        # The current plan's rows, and what its reusing calls share (``_shared``).
        self._by_plan: tuple[RowTensors, dict[str, torch.Tensor]] | None = None
        self._reused: list[tuple[torch.Tensor, torch.Tensor]] = []    # (ok, count) of the plan's reused calls

    def new_step(self) -> None:
        self._serial += 1

    def reusable(self, layer_name: str) -> bool:
        """Whether this step's call of the layer reuses its last choice: one
        made at the step just before, that has served fewer than
        ``every - 1`` steps since it was scored."""
        if self.every <= 1:
            return False
        choice = self._choices.get(layer_name)
        return choice is not None and choice.serial == self._serial - 1 and choice.age < self.every - 1

    def _shared(self, plan: StepPlan, t: RowTensors) -> dict[str, torch.Tensor]:
        """What every layer call of the plan uses: each row's last block and
        its id (a plan's ``RowTensors`` are its own: a new plan, new ones)."""
        if self._by_plan is None or self._by_plan[0] is not t:
            last = (t.num_blocks - 1).clamp(0, plan.width - 1)
            self._by_plan = (t, {"last": last, "last_ids": t.table.gather(1, last.unsqueeze(1)).squeeze(1)})
        return self._by_plan[1]

    def record(self, layer_name: str, batch: AttentionBatch, plan: StepPlan, positions: torch.Tensor) -> None:
        """Keep a fresh choice: ``positions`` as ``torch_select.select``
        returns them."""
        if self.every <= 1:
            return
        t = plan.tensors(batch)
        shared = self._shared(plan, t)
        self._choices[layer_name] = Choice(self._serial, 0, positions, t.keep, t.num_blocks, shared["last_ids"],
                                           t.thin)

    def buffers(self, rows: int, k: int, device: torch.device) -> tuple[torch.Tensor, ...] | None:
        """Where the Triton kernels write a fresh choice (``keep`` it after),
        or None when choices are not kept."""
        if self.every <= 1:
            return None
        return (torch.empty((rows, k), dtype=torch.int64, device=device),
                *(torch.empty(rows, dtype=torch.int64, device=device) for _ in range(3)),
                torch.empty(rows, dtype=torch.int8, device=device))

    def keep(self, layer_name: str, buffers: tuple[torch.Tensor, ...]) -> None:
        """Keep the fresh choice the kernels wrote into ``buffers``."""
        positions, count, num_blocks, last_ids, thin = buffers
        self._choices[layer_name] = Choice(self._serial, 0, positions, count, num_blocks, last_ids,
                                           thin.view(torch.bool))

    def reuse(self, layer_name: str, batch: AttentionBatch, plan: StepPlan,
              triton: tuple[torch.Tensor, torch.Tensor] | None = None) -> BlockSelection:
        """This call's selection from the layer's last choice (``reusable``
        said yes).  ``triton``: ``(keep table, device counters)`` to reuse
        in one kernel; otherwise torch ops, whose counts go to the device
        counters at ``flush``."""
        if triton is not None:
            return self._reuse_triton(layer_name, batch, plan, *triton)
        last = self._choices[layer_name]
        t = plan.tensors(batch)
        shared = self._shared(plan, t)
        table, _ = plan.outputs(batch)
        rows, width = plan.num_rows, plan.width
        k = min(last.positions.shape[1] + 1, table.shape[1])      # room for one new block per row
        positions, count, num_blocks, last_ids, thin = _fit(last, rows, k, width, t.table.device)
        # The row still holds the block it read last, at the same position,
        # and has at most one block more.
        was_last = t.table.gather(1, (num_blocks - 1).clamp_(0, width - 1).unsqueeze(1)).squeeze(1)
        grew = t.num_blocks - num_blocks
        ok = (was_last == last_ids) & thin & t.thin & ((grew | 1) == 1)
        # A row that started a block reads it too, after the ones it read.
        started = grew == 1
        positions.scatter_(1, count.clamp(max=k - 1).unsqueeze(1),
                           torch.where(started, shared["last"], width).unsqueeze(1))
        count = count + started
        blocks = t.table.gather(1, positions.clamp(0, width - 1)).to(table.dtype)
        # A row read whole gets back its own table as far as any reuse of
        # the step wrote into it (a fresh choice writes thinned rows only).
        written = shared["written"] = max(k, shared.get("written", 0))
        if written > k:
            blocks = torch.nn.functional.pad(blocks, (0, written - k))
        table[:rows, :written] = torch.where(ok.unsqueeze(1), blocks, batch.block_table[:rows, :written])
        seq_lens = torch.where(ok, (count - 1) * batch.block_size + t.last_fill, batch.seq_lens)
        self._reused.append((ok, count))
        self._choices[layer_name] = Choice(self._serial, last.age + 1, positions, count, t.num_blocks,
                                           shared["last_ids"], ok)
        return BlockSelection(block_table=table, seq_lens=seq_lens.to(batch.seq_lens.dtype))

    def _reuse_triton(self, layer_name: str, batch: AttentionBatch, plan: StepPlan, keep: torch.Tensor,
                      totals: torch.Tensor) -> BlockSelection:
        last = self._choices[layer_name]
        table, _ = plan.outputs(batch)
        seq_lens = torch.empty_like(batch.seq_lens)
        state = triton_select.reuse(last, batch, width=plan.width, keep=keep, out_table=table,
                                    out_seq_lens=seq_lens, totals=totals, sink_blocks=plan.options.sink_blocks,
                                    local_blocks=plan.options.local_blocks, query_tokens=plan.query_tokens)
        self._choices[layer_name] = Choice(self._serial, last.age + 1, *state)
        return BlockSelection(block_table=table, seq_lens=seq_lens)

    def flush(self, totals: torch.Tensor | None) -> None:
        """Add the counts of the step's reused calls to the device counters."""
        if not self._reused:
            return
        oks, counts = (torch.stack(x) for x in zip(*self._reused))
        t = self._by_plan[0]
        calls = len(self._reused)
        self._reused = []
        with torch.inference_mode():
            totals += increment(t.is_decode, t.num_blocks, None, None) * calls
            sparse = oks.sum()
            dropped = ((t.num_blocks - counts) * oks).sum()
            totals[_SPARSE_ROWS] += sparse
            totals[_ROWS_REUSED] += sparse
            totals[_BLOCKS_READ] -= dropped


def _fit(last: Choice, rows: int, k: int, width: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The last choice's tensors for ``rows`` rows and ``k`` columns: rows
    it did not have are not thinned, new columns are past every row's
    count."""
    k_last = last.positions.shape[1]
    if last.positions.shape[0] == rows:
        positions = torch.nn.functional.pad(last.positions, (0, k - k_last), value=width)
        return positions, last.count, last.num_blocks, last.last_ids, last.thin
    n = min(rows, last.positions.shape[0])
    positions = torch.full((rows, k), width, dtype=torch.int64, device=device)
    positions[:n, :k_last] = last.positions[:n]
    count, num_blocks, last_ids = (torch.zeros(rows, dtype=torch.int64, device=device) for _ in range(3))
    thin = torch.zeros(rows, dtype=torch.bool, device=device)
    for new, old in ((count, last.count), (num_blocks, last.num_blocks), (last_ids, last.last_ids),
                     (thin, last.thin)):
        new[:n] = old[:n]
    return positions, count, num_blocks, last_ids, thin
