"""Triton kernels for ``block_topk`` on CUDA: a decode layer call in two
launches, none of which waits for the host or makes the host wait.

* ``score_and_select``: (1) one program per (row, KV head, tile of block
  positions) reads the summaries through the block table (no gathered copy)
  and writes ``scale * q . mean`` per query head and position, summed over a
  block's slices in log space (Quest's bound with ``score: bound``); in a
  decode-only call it first folds the row's new key into its last block's
  summary, the one program that reads that row for that head; (2) one
  program per row soft-maxes the query heads over the row's blocks (several
  heads at a time), averages over heads, forces the sinks and the local
  window, finds the budget's worth of best positions with a bitwise search
  for the k-th score (no sort), writes their block ids in position order and
  the new length, and adds the row's counts to the device counters.
* ``fold_decode``: the fold alone, for decode calls that select nothing, that
  the torch path selects, or that reuse a choice;
* ``reuse``: a choice of the step before, reused (``topk_reuse``), one
  program per row.

The math is ``torch_select.scores`` and ``torch_select.select``'s, step for step;
only the floating-point order differs (blocks chosen can differ where two
scores tie to rounding).  Shapes come from host-side facts: rows, the longest
row's block count ``width``, and a power of two above it per row.

Knows tensors and the summaries' layout; nothing of vLLM.  Importing it
without Triton is fine: ``available()`` says False.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:            # CPU-only installs: the torch path runs instead
    triton = None
    tl = None

#: Block positions per program of the scoring kernel, and its warps.  On an
#: H100 at 32k-token rows (batch 8, Llama-3-8B attention shapes) 8 positions
#: and one warp read the summaries in 30.6 us against 86.3 us with 32 and 4
#: warps, 10.6 against 24.9 us at 8k, choosing the same blocks
#: (benchmarks/RESULTS.md): small programs keep a tile's summaries and the
#: query group's products in registers.
LOGITS_TILE = 8
LOGITS_WARPS = 1


def available() -> bool:
    return triton is not None


#: Each kernel's integer arguments: sizes and strides, which Triton would
#: otherwise compile a variant for by value (1, a multiple of 16, or
#: neither).  They change from step to step (rows, the longest row) or
#: between vLLM's tensors and a warm-up's, so none is specialised: the
#: variants a layer can launch are set by its shapes, its flags and the
#: power of two above the longest row alone, and ``BlockTopK.warm_up``
#: launches every one of them at start-up.
RUNTIME_INTS = {
    "_fold_decode_kernel": ["key_s0", "key_s1", "kv_s0", "kv_s1"],
    "_block_logits_kernel": ["q_s0", "q_s1", "table_s0", "width", "key_s0", "key_s1", "kv_s0", "kv_s1"],
    "_select_kernel": ["width", "num_rows", "table_s0", "max_q", "out_table_s0", "choice_k"],
    "_reuse_kernel": ["pos_s0", "k_last", "rows_last", "table_s0", "width", "num_rows", "max_q", "out_table_s0",
                      "k"],
}
#: The pointers into vLLM's attention metadata, which Triton would also
#: tell apart by 16-byte alignment: a row of a buffer shared by KV cache
#: groups, or a micro-batch's slice of the metadata, may start anywhere.
RUNTIME_POINTERS = {
    "_fold_decode_kernel": ["slot_ptr"],
    "_block_logits_kernel": ["qsl_ptr", "seq_ptr", "table_ptr", "slot_ptr"],
    "_select_kernel": ["qsl_ptr", "seq_ptr", "table_ptr"],
    "_reuse_kernel": ["qsl_ptr", "seq_ptr", "table_ptr"],
}


def _jit(name: str):
    return triton.jit(do_not_specialize=RUNTIME_INTS[name], do_not_specialize_on_alignment=RUNTIME_POINTERS[name])


def pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


if triton is not None:

    @triton.jit
    def _start_block(block, made_at_ptr, epochs_ptr, probe_ptr, BS: tl.constexpr, BSP: tl.constexpr):
        # A block's first token: its summary is made at the block's epoch,
        # and has no probe until the block is complete.
        tl.store(made_at_ptr + block, tl.load(epochs_ptr + block))
        tt = tl.arange(0, BSP)
        tl.store(probe_ptr + block * BS + tt, tl.full((BSP,), float("nan"), tl.float32), mask=tt < BS)

    @triton.jit
    def _take_probe(block, kv_ptr, kv_s0, kv_s1, made_at_ptr, epochs_ptr, probe_ptr,
                    BS: tl.constexpr, BSP: tl.constexpr, KD: tl.constexpr):
        # The block is complete: remember one key element per token (kv
        # head 0, dim t % KD, KD the page's head size), read back from the
        # page itself, if this summary saw the block start (else it vouches
        # for nothing: NaN never matches).
        tt = tl.arange(0, BSP)
        probe = tl.load(kv_ptr + block * kv_s0 + tt * kv_s1 + (tt % KD), mask=tt < BS)
        seen_start = tl.load(made_at_ptr + block) == tl.load(epochs_ptr + block)
        probe = tl.where(seen_start, probe.to(tl.float32), float("nan"))
        tl.store(probe_ptr + block * BS + tt, probe, mask=tt < BS)

    @_jit("_fold_decode_kernel")
    def _fold_decode_kernel(key_ptr, key_s0, key_s1, slot_ptr, epochs_ptr, made_at_ptr,
                            sum_ptr, minmax_ptr, probe_ptr, kv_ptr, kv_s0, kv_s1,
                            BS: tl.constexpr, BSP: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
                            DP: tl.constexpr, P: tl.constexpr, PS: tl.constexpr, KD: tl.constexpr,
                            BOUNDS: tl.constexpr, PROBE: tl.constexpr):
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            block = slot // BS
            offset = slot % BS
            h = tl.arange(0, HP)[:, None]
            d = tl.arange(0, DP)[None, :]
            hd = (h < H) & (d < D)
            key = tl.load(key_ptr + t * key_s0 + h * key_s1 + d, mask=hd, other=0.0).to(tl.float32)
            base = sum_ptr + block * (P * H * D) + h * D + d
            if offset == 0:
                # A block's first token: whatever the block held before is gone.
                for p in tl.static_range(P):
                    if p == 0:
                        tl.store(base, key, mask=hd)
                    else:
                        tl.store(base + p * (H * D), tl.zeros_like(key), mask=hd)
                if BOUNDS:
                    mm = minmax_ptr + block * (H * 2 * D) + h * (2 * D) + d
                    tl.store(mm, key, mask=hd)
                    tl.store(mm + D, key, mask=hd)
                _start_block(block, made_at_ptr, epochs_ptr, probe_ptr, BS, BSP)
            else:
                ptr = base + (offset // PS) * (H * D)
                tl.store(ptr, tl.load(ptr, mask=hd, other=0.0) + key, mask=hd)
                if BOUNDS:
                    mm = minmax_ptr + block * (H * 2 * D) + h * (2 * D) + d
                    tl.store(mm, tl.maximum(tl.load(mm, mask=hd, other=0.0), key), mask=hd)
                    tl.store(mm + D, tl.minimum(tl.load(mm + D, mask=hd, other=0.0), key), mask=hd)
            if PROBE:
                if offset == BS - 1:
                    _take_probe(block, kv_ptr, kv_s0, kv_s1, made_at_ptr, epochs_ptr, probe_ptr, BS, BSP, KD)

    @_jit("_block_logits_kernel")
    def _block_logits_kernel(q_ptr, q_s0, q_s1, qsl_ptr, seq_ptr, table_ptr, table_s0,
                             sum_ptr, minmax_ptr, out_ptr, width, scale,
                             key_ptr, key_s0, key_s1, slot_ptr, epochs_ptr, made_at_ptr, probe_ptr,
                             kv_ptr, kv_s0, kv_s1,
                             BS: tl.constexpr, BSP: tl.constexpr, H: tl.constexpr, G: tl.constexpr,
                             GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, P: tl.constexpr,
                             PS: tl.constexpr, KD: tl.constexpr, TJ: tl.constexpr, BOUND: tl.constexpr,
                             Q_IN_ORDER: tl.constexpr, FOLD: tl.constexpr, PROBE: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1)
        j = tl.program_id(2) * TJ + tl.arange(0, TJ)
        seq = tl.load(seq_ptr + r).to(tl.int64)
        n = (seq + BS - 1) // BS
        valid = j < n
        block = tl.load(table_ptr + r * table_s0 + j, mask=valid, other=0).to(tl.int64)
        if Q_IN_ORDER:
            tok = r.to(tl.int64)
        else:
            # A row without query tokens (not thinned: any token will do)
            # may start past the last one.
            first = tl.load(qsl_ptr + r).to(tl.int64)
            tok = tl.where(tl.load(qsl_ptr + r + 1) > first, first, 0)
        g = tl.arange(0, GP)
        d = tl.arange(0, DP)
        dmask = d < D
        gd = (g[:, None] < G) & dmask[None, :]
        q = tl.load(q_ptr + tok * q_s0 + (h * G + g[:, None]) * q_s1 + d[None, :], mask=gd,
                    other=0.0).to(tl.float32)                                     # [GP, DP]
        vd = valid[:, None] & dmask[None, :]                                      # [TJ, DP]
        # FOLD (decode-only calls): row r's one new token is the last of its
        # last block, which this program alone reads for head h: its key is
        # folded into the summary rows in registers, and those rows are
        # written back, so that no other thread reads a half-updated row.
        here = j == -1
        offset = 0
        fold_block = 0
        key = tl.zeros((DP,), tl.float32)
        if FOLD:
            slot = tl.load(slot_ptr + r).to(tl.int64)
            mine = (slot >= 0) & ((n - 1) // TJ == tl.program_id(2))
            here = (j == n - 1) & mine
            offset = tl.where(slot >= 0, slot % BS, 0)
            fold_block = tl.where(slot >= 0, slot // BS, 0)
            key = tl.load(key_ptr + r * key_s0 + h * key_s1 + d, mask=dmask & mine, other=0.0).to(tl.float32)
            if mine:
                if BOUND:
                    # Slice sums are kept for either score; nobody else reads them here.
                    part_row = sum_ptr + (fold_block * P + offset // PS) * (H * D) + h * D + d
                    if offset == 0:
                        for p in tl.static_range(P):
                            tl.store(sum_ptr + (fold_block * P + p) * (H * D) + h * D + d,
                                     tl.zeros((DP,), tl.float32), mask=dmask)
                        tl.store(part_row, key, mask=dmask)
                    else:
                        tl.store(part_row, tl.load(part_row, mask=dmask, other=0.0) + key, mask=dmask)
                if h == 0:
                    if offset == 0:
                        _start_block(fold_block, made_at_ptr, epochs_ptr, probe_ptr, BS, BSP)
                    if PROBE:
                        if offset == BS - 1:
                            _take_probe(fold_block, kv_ptr, kv_s0, kv_s1, made_at_ptr, epochs_ptr, probe_ptr,
                                        BS, BSP, KD)
        start = offset == 0
        if BOUND:
            rows = minmax_ptr + block[:, None] * (H * 2 * D) + h * (2 * D) + d[None, :]
            kmax = tl.load(rows, mask=vd, other=0.0)
            kmin = tl.load(rows + D, mask=vd, other=0.0)
            if FOLD:
                kmax = tl.where(here[:, None], tl.where(start, key[None, :], tl.maximum(kmax, key[None, :])), kmax)
                kmin = tl.where(here[:, None], tl.where(start, key[None, :], tl.minimum(kmin, key[None, :])), kmin)
                write = here[:, None] & dmask[None, :]
                tl.store(rows, kmax, mask=write)
                tl.store(rows + D, kmin, mask=write)
            qpos = tl.maximum(q, 0.0)
            qneg = tl.minimum(q, 0.0)
            logit = tl.sum(qpos[:, None, :] * kmax[None, :, :] + qneg[:, None, :] * kmin[None, :, :], axis=2)
            # A summary that bounds no key (min +inf, max -inf) gives NaN
            # (0 * inf), as do NaN keys: the block is worth nothing, rather
            # than the whole row's softmax turning NaN (as in torch_select).
            logit = tl.where(logit == logit, logit * scale, float("-inf"))
            logit = tl.where(valid[None, :], logit, float("-inf"))
        else:
            last_fill = seq - (n - 1) * BS
            fill = tl.where(j == n - 1, last_fill, BS)
            fill = tl.where(valid, fill, 0)
            m = tl.full((GP, TJ), float("-inf"), tl.float32)
            acc = tl.zeros((GP, TJ), tl.float32)
            logit = tl.zeros((GP, TJ), tl.float32)
            for p in tl.static_range(P):
                rows = sum_ptr + (block[:, None] * P + p) * (H * D) + h * D + d[None, :]
                summ = tl.load(rows, mask=vd, other=0.0)                          # [TJ, DP]
                if FOLD:
                    ours = here & (offset // PS == p)
                    summ = tl.where(here[:, None] & start, 0.0, summ)
                    summ = tl.where(ours[:, None], summ + key[None, :], summ)
                    tl.store(rows, summ, mask=here[:, None] & dmask[None, :])
                dot = tl.sum(q[:, None, :] * summ[None, :, :], axis=2)             # [GP, TJ]
                count = tl.minimum(tl.maximum(fill - p * PS, 0), PS).to(tl.float32)
                lp = dot * (scale / tl.maximum(count, 1.0))[None, :] + tl.log(count)[None, :]
                lp = tl.where(lp == lp, lp, float("-inf"))       # a slice of NaN keys: worth nothing
                if P == 1:
                    logit = lp
                else:
                    # log-sum-exp over the slices, online; all -inf stays -inf.
                    m_new = tl.maximum(m, lp)
                    safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                    acc = acc * tl.exp(m - safe) + tl.exp(lp - safe)
                    m = m_new
            if P > 1:
                logit = tl.where(m == float("-inf"), float("-inf"), m + tl.log(acc))
        out = out_ptr + (r * (H * G) + h * G + g[:, None]) * width + j[None, :]
        tl.store(out, logit, mask=(g[:, None] < G) & (j[None, :] < width))

    @triton.jit
    def _row(r, qsl_ptr, seq_ptr, keep_ptr, max_q, BS: tl.constexpr, WP: tl.constexpr, SINK: tl.constexpr,
             LOCAL: tl.constexpr):
        # Row r's facts: a decode row (1 to max_q query tokens)?, its tokens,
        # blocks, tail (always read: the blocks of its new tokens, at least
        # LOCAL), budget (room for the sinks and the tail), and whether it
        # is thinned.
        qlen = (tl.load(qsl_ptr + r + 1) - tl.load(qsl_ptr + r)).to(tl.int64)
        seq = tl.load(seq_ptr + r).to(tl.int64)
        n = (seq + BS - 1) // BS
        decode = (qlen >= 1) & (qlen <= max_q)
        tail = tl.maximum(n - tl.maximum(seq - qlen, 0) // BS, LOCAL)
        keep = tl.load(keep_ptr + tl.minimum(n, WP)).to(tl.int64)
        keep = tl.where(decode, tl.maximum(keep, SINK + tail), keep)
        return decode, seq, n, keep, decode & (keep < n) & (seq > 0), tail

    @triton.jit
    def _count_row(totals_ptr, r, num_rows, qsl_ptr, max_q, decode, thin, read, n):
        # Counters, in topk_plan.STATS order: ``read`` blocks of a thinned
        # row, all ``n`` of another decode row.
        tl.atomic_add(totals_ptr + 1, decode.to(tl.int64))
        tl.atomic_add(totals_ptr + 2, thin.to(tl.int64))
        tl.atomic_add(totals_ptr + 3, tl.where(decode, tl.where(thin, read, n), 0))
        tl.atomic_add(totals_ptr + 4, tl.where(decode, n, 0))
        if r == 0:
            # Whether the call has a decode row, over the rows 128 at a time:
            # the batch size is no compile-time constant (a new one would
            # compile new variants of the kernels in the middle of serving).
            chunk = tl.arange(0, 128)
            any_decode = tl.max(tl.zeros((128,), tl.int64), axis=0)
            for r0 in range(0, num_rows, 128):
                rr = r0 + chunk
                inside = rr < num_rows
                lens = tl.load(qsl_ptr + rr + 1, mask=inside, other=0) - tl.load(qsl_ptr + rr, mask=inside, other=0)
                any_decode = tl.maximum(any_decode, tl.max(((lens >= 1) & (lens <= max_q) & inside).to(tl.int64),
                                                           axis=0))
            tl.atomic_add(totals_ptr + 0, any_decode)

    @_jit("_select_kernel")
    def _select_kernel(logits_ptr, width, num_rows, qsl_ptr, seq_ptr, table_ptr, table_s0, max_q,
                       keep_ptr, out_table_ptr, out_table_s0, out_seq_ptr, totals_ptr,
                       choice_pos_ptr, choice_k, choice_count_ptr, choice_nb_ptr, choice_last_ptr, choice_thin_ptr,
                       BS: tl.constexpr, HQ: tl.constexpr, HB: tl.constexpr, WP: tl.constexpr,
                       SINK: tl.constexpr, LOCAL: tl.constexpr, CHOICE: tl.constexpr):
        r = tl.program_id(0)
        decode, seq, n, keep, thin, tail = _row(r, qsl_ptr, seq_ptr, keep_ptr, max_q, BS, WP, SINK, LOCAL)
        last_fill = seq - (n - 1) * BS
        new_seq = tl.where(thin, (keep - 1) * BS + last_fill, seq)
        tl.store(out_seq_ptr + r, new_seq.to(out_seq_ptr.dtype.element_ty))
        if CHOICE:
            # What a later step needs to reuse this choice (topk_reuse.Choice).
            tl.store(choice_count_ptr + r, keep)
            tl.store(choice_nb_ptr + r, n)
            last = tl.minimum(tl.maximum(n - 1, 0), width - 1)
            tl.store(choice_last_ptr + r, tl.load(table_ptr + r * table_s0 + last).to(tl.int64))
            tl.store(choice_thin_ptr + r, thin.to(tl.int8))
        _count_row(totals_ptr, r, num_rows, qsl_ptr, max_q, decode, thin, keep, n)
        if thin:
            j = tl.arange(0, WP)
            valid = j < n
            # Soft-max of each query head over the row's blocks, averaged over
            # heads: HB heads at a time, so that the reductions run side by side.
            share = tl.zeros((WP,), tl.float32)
            hb = tl.arange(0, HB)
            for h0 in range(0, HQ, HB):
                heads = h0 + hb
                logit = tl.load(logits_ptr + (r * HQ + heads[:, None]) * width + j[None, :],
                                mask=(heads[:, None] < HQ) & (j[None, :] < width), other=float("-inf"))
                e = tl.exp(logit - tl.max(logit, axis=1)[:, None])
                e = e / tl.sum(e, axis=1)[:, None]
                share += tl.sum(tl.where(heads[:, None] < HQ, e, 0.0), axis=0)
            score = share / HQ
            # NaN would outrank the forced blocks' inf in the bit order below.
            score = tl.where(score == score, score, float("-inf"))
            forced = ((j < SINK) | (j >= n - tail)) & valid
            score = tl.where(forced, float("inf"), score)
            score = tl.where(valid, score, float("-inf"))
            # The budget's worth of best positions without sorting: the
            # float's bits made monotonic, the keep-th largest found bit by
            # bit (a count per bit), ties at it taken lowest position first.
            bits = score.to(tl.int32, bitcast=True)
            bits = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
            key = bits.to(tl.int64) + 2147483648                               # 0 .. 2**32 - 1
            edge = keep * 0
            for b in tl.static_range(32):
                trial = edge | (1 << (31 - b))
                edge = tl.where(tl.sum((key >= trial).to(tl.int32), axis=0) >= keep, trial, edge)
            above = key > edge
            tie = key == edge
            room = keep - tl.sum(above.to(tl.int64), axis=0)
            chosen = above | (tie & (tl.cumsum(tie.to(tl.int64), axis=0) <= room))
            # In position order: each chosen position's rank among the chosen.
            slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
            blocks = tl.load(table_ptr + r * table_s0 + j, mask=chosen, other=0)
            tl.store(out_table_ptr + r * out_table_s0 + slot, blocks, mask=chosen)
            if CHOICE:
                tl.store(choice_pos_ptr + r * choice_k + slot, j.to(tl.int64), mask=chosen)


if triton is not None:
    @_jit("_reuse_kernel")
    def _reuse_kernel(pos_ptr, pos_s0, k_last, rows_last, count_ptr, nb_ptr, last_ids_ptr, thin_ptr,
                      qsl_ptr, seq_ptr, table_ptr, table_s0, keep_ptr, width, num_rows, max_q,
                      out_table_ptr, out_table_s0, out_seq_ptr,
                      new_pos_ptr, k, new_count_ptr, new_nb_ptr, new_last_ids_ptr, new_thin_ptr, totals_ptr,
                      BS: tl.constexpr, WP: tl.constexpr, SINK: tl.constexpr, LOCAL: tl.constexpr):
        # One program per row: the row's choice at the step before, if it
        # still describes the row (topk_reuse), plus its new last block.
        r = tl.program_id(0)
        decode, seq, n, _keep, thin_now, _tail = _row(r, qsl_ptr, seq_ptr, keep_ptr, max_q, BS, WP, SINK, LOCAL)
        had = r < rows_last
        cnt = tl.load(count_ptr + r, mask=had, other=0)
        nb_then = tl.load(nb_ptr + r, mask=had, other=0)
        last_id = tl.load(last_ids_ptr + r, mask=had, other=-1)
        thin_then = tl.load(thin_ptr + r, mask=had, other=0) != 0
        row = table_ptr + r * table_s0
        was_last = tl.load(row + tl.minimum(tl.maximum(nb_then - 1, 0), width - 1)).to(tl.int64)
        grew = n - nb_then
        ok = had & thin_then & thin_now & (was_last == last_id) & ((grew == 0) | (grew == 1))
        started = grew == 1
        j = tl.arange(0, WP)
        # Positions are read only where a choice has them (a row it did not
        # thin has none written), and kept inside the row.
        pos = tl.load(pos_ptr + r * pos_s0 + j, mask=had & thin_then & (j < k_last) & (j < cnt), other=width)
        pos = tl.where((j == cnt) & started, n - 1, pos)
        count = cnt + started.to(tl.int64)
        blocks = tl.load(row + tl.minimum(tl.maximum(pos, 0), width - 1), mask=ok & (j < k), other=0)
        last_fill = seq - (n - 1) * BS
        tl.store(out_seq_ptr + r, tl.where(ok, (count - 1) * BS + last_fill, seq).to(out_seq_ptr.dtype.element_ty))
        out_row = out_table_ptr + r * out_table_s0
        if ok:
            tl.store(out_row + j, blocks.to(out_table_ptr.dtype.element_ty), mask=j < count)
        else:
            # Read whole: the row's own table, whatever an earlier layer of
            # the step wrote there.
            c = tl.arange(0, WP)
            tl.store(out_row + c, tl.load(row + c, mask=c < n), mask=c < n)
        tl.store(new_pos_ptr + r * k + j, pos, mask=j < k)
        tl.store(new_count_ptr + r, count)
        tl.store(new_nb_ptr + r, n)
        tl.store(new_last_ids_ptr + r, tl.load(row + tl.minimum(tl.maximum(n - 1, 0), width - 1)).to(tl.int64))
        tl.store(new_thin_ptr + r, ok.to(tl.int8))
        _count_row(totals_ptr, r, num_rows, qsl_ptr, max_q, decode, ok, count, n)
        tl.atomic_add(totals_ptr + 8, ok.to(tl.int64))                    # rows_reused

    _reuse_launch = _reuse_kernel.__getitem__
    _fold_launch = _fold_decode_kernel.__getitem__
    _logits_launch = _block_logits_kernel.__getitem__
    _select_launch = _select_kernel.__getitem__


_DUMMY: dict[torch.device, torch.Tensor] = {}


def _dummy(device: torch.device) -> torch.Tensor:
    if device not in _DUMMY:
        _DUMMY[device] = torch.zeros(1, dtype=torch.float32, device=device)
    return _DUMMY[device]


def _key_view(pages):
    """The pages' token-major key view and whether probes can be read from it."""
    view = pages.key_view() if pages is not None else None
    if view is None or view.stride(3) != 1:
        return None
    return view


def _probe_dims(view, head_size: int) -> int:
    """The head size of the pages probes are read from (a summary's keys
    may be fewer channels: ``channels``)."""
    return view.shape[3] if view is not None else head_size


def fold_decode(layer, key: torch.Tensor, slot_mapping: torch.Tensor, epochs: torch.Tensor, pages) -> None:
    """``LayerSummaries.add_keys`` for a decode-only call (at most one new
    token per block), in one launch."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    assert key.stride(2) == 1, "keys must be contiguous along the head dimension"
    view = _key_view(pages)
    device = key.device
    kv = view if view is not None else _dummy(device)
    h, d = layer.num_kv_heads, layer.head_size
    _fold_launch((num_tokens,))(
        key, key.stride(0), key.stride(1), slot_mapping, epochs, layer.made_at,
        layer.part_sum, layer.minmax if layer.minmax is not None else _dummy(device), layer.probe,
        kv, kv.stride(0) if view is not None else 0, kv.stride(1) if view is not None else 0,
        BS=layer.block_size, BSP=pow2(layer.block_size), H=h, HP=pow2(h), D=d, DP=pow2(d), P=layer.parts,
        PS=layer.part_size, KD=_probe_dims(view, d), BOUNDS=layer.minmax is not None, PROBE=view is not None,
        num_warps=1)


def score_and_select(layer, batch, *, width: int, keep: torch.Tensor, sink_blocks: int, local_blocks: int,
                     bound: bool, query_in_order: bool, out_table: torch.Tensor, out_seq_lens: torch.Tensor,
                     totals: torch.Tensor, logits: torch.Tensor, fold: tuple | None = None,
                     choice: tuple | None = None, tile: int = LOGITS_TILE, query_tokens: int = 1) -> None:
    """Score every block of every row and write the selection into
    ``out_table`` (chosen blocks of thinned rows, first columns) and
    ``out_seq_lens`` (every row); two launches.  ``keep`` is the budget by
    block count (a lookup table of at least ``width + 1`` entries);
    ``logits`` a ``[rows, query heads, width]`` fp32 scratch.  With ``fold``
    = ``(epochs,)`` (decode-only calls) the first launch also folds the new
    keys into the summaries, as ``fold_decode`` would.  With ``choice`` =
    ``(positions [rows, k], count, num_blocks, last_ids, thin)`` it also
    writes what ``topk_reuse`` keeps of the choice: the chosen positions in
    order (thinned rows' first ``count`` columns), and per row the budget,
    the block count, the last block's id and whether it was thinned (int8).
    Decode rows have 1 to ``query_tokens`` query tokens (``RowTensors``)."""
    query = batch.query
    rows = batch.seq_lens.shape[0]
    num_heads, h, d = query.shape[1], batch.num_kv_heads, batch.head_size
    assert query.stride(2) == 1, "queries must be contiguous along the head dimension"
    group = num_heads // h
    device = query.device
    table = batch.block_table
    if bound:
        summaries, minmax, parts, part_size = layer.part_sum, layer.minmax, layer.parts, layer.part_size
    else:
        summaries, minmax, parts, part_size = layer.part_sum, _dummy(device), layer.parts, layer.part_size
    if fold is not None:
        (epochs,) = fold
        key, slots = batch.key, batch.slot_mapping
        assert key.stride(2) == 1, "keys must be contiguous along the head dimension"
        view = _key_view(batch.pages)
        kv = view if view is not None else _dummy(device)
        fold_args = (key, key.stride(0), key.stride(1), slots, epochs, layer.made_at, layer.probe,
                     kv, kv.stride(0) if view is not None else 0, kv.stride(1) if view is not None else 0)
    else:
        view = None
        dummy = _dummy(device)
        fold_args = (dummy, 0, 0, dummy, dummy, dummy, dummy, dummy, 0, 0)
    _logits_launch((rows, h, -(-width // tile)))(
        query, query.stride(0), query.stride(1), batch.query_start_loc, batch.seq_lens, table, table.stride(0),
        summaries, minmax, logits, width, float(batch.scale), *fold_args,
        BS=batch.block_size, BSP=pow2(batch.block_size), H=h, G=group, GP=pow2(group), D=d, DP=pow2(d),
        P=parts, PS=part_size, KD=_probe_dims(view, d), TJ=tile, BOUND=bound, Q_IN_ORDER=query_in_order,
        FOLD=fold is not None, PROBE=view is not None, num_warps=LOGITS_WARPS)
    width_pow2 = max(16, pow2(width))
    assert keep.numel() >= width_pow2 + 1
    if choice is not None:
        positions = choice[0]
        assert positions.is_contiguous() and positions.dtype == torch.int64
        choice_args = (positions, positions.shape[1], *choice[1:])
    else:
        dummy = _dummy(device)
        choice_args = (dummy, 0, dummy, dummy, dummy, dummy)
    _select_launch((rows,))(
        logits, width, rows, batch.query_start_loc, batch.seq_lens, table, table.stride(0), query_tokens,
        keep, out_table, out_table.stride(0), out_seq_lens, totals, *choice_args,
        CHOICE=choice is not None, BS=batch.block_size, HQ=num_heads,
        HB=max(1, min(pow2(num_heads), 16384 // width_pow2)), WP=width_pow2,
        SINK=sink_blocks, LOCAL=local_blocks, num_warps=4 if width_pow2 <= 1024 else 8)


def reuse(last, batch, *, width: int, keep: torch.Tensor, out_table: torch.Tensor, out_seq_lens: torch.Tensor,
          totals: torch.Tensor, sink_blocks: int, local_blocks: int, query_tokens: int = 1
          ) -> tuple[torch.Tensor, ...]:
    """``topk_reuse.KeptChoices.reuse`` in one launch: each row's choice of
    the step before (``last``, a ``Choice``) if it still describes the row,
    plus its new last block; other rows read whole.  Writes ``out_table``
    and ``out_seq_lens`` (every row) and returns the new choice's positions,
    counts, block counts, last block ids and thinned rows."""
    rows = batch.seq_lens.shape[0]
    rows_last, k_last = last.positions.shape
    width_pow2 = max(16, pow2(width))
    # Room for one new block per row; a row's choice never holds more
    # positions than the row has blocks, so the columns stop at
    # ``width_pow2``, the kernel's one tile (its only size constant).
    k = min(k_last + 1, out_table.shape[1], width_pow2)
    device = batch.seq_lens.device
    positions = torch.empty((rows, k), dtype=torch.int64, device=device)
    count, num_blocks, last_ids = (torch.empty(rows, dtype=torch.int64, device=device) for _ in range(3))
    thin = torch.empty(rows, dtype=torch.int8, device=device)
    table = batch.block_table
    assert keep.numel() >= width_pow2 + 1
    _reuse_launch((rows,))(
        last.positions, last.positions.stride(0), k_last, rows_last, last.count, last.num_blocks, last.last_ids,
        last.thin, batch.query_start_loc, batch.seq_lens, table, table.stride(0), keep, width, rows, query_tokens,
        out_table, out_table.stride(0), out_seq_lens, positions, k, count, num_blocks, last_ids, thin, totals,
        BS=batch.block_size, WP=width_pow2, SINK=sink_blocks, LOCAL=local_blocks,
        num_warps=4 if width_pow2 <= 1024 else 8)
    return positions, count, num_blocks, last_ids, thin.view(torch.bool)
