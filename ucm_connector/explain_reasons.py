"""``ucm explain``'s verdict: how much of the prompt a request would load,
the first block it would not, and the likely reason.

Owns the reasons ``explain.HELP`` lists, tried from the most specific to
the least: the prompt is too short to load anything; no namespace of this
engine (another namespace or model holds it, the store holds nothing for
this model, or nothing matches the selection); fewer leading blocks than
``--min-hit-blocks``; a full hit; a TP rank's shard is missing; a later
block is there (this one was evicted); the prompt is stored without the
given cache_salt or LoRA adapter; another namespace holds more of it; or
the prompt diverges there from everything stored.

What it must not do: touch the store or the command line: it works only on
what ``explain.explain`` found (``Findings``), and returns a ``Report``
without printing it.  It never puts a cache_salt value in a message.
"""

from __future__ import annotations

from .cli.output import plural
from .explain_lookup import Block, say_differences, say_selection
from .explain_report import Findings, Report


def conclude(found: Findings) -> Report:
    """The report: the hit, the first miss and the most specific reason."""
    num_tokens, target, others, same_model = found.num_tokens, found.target, found.others, found.same_model
    if target is not None:
        block_size = target.block_size
        blocks = list(target.blocks)
        max_blocks = target.max_blocks
        hit = target.hit_blocks
    else:
        # No namespace of this engine: nothing is stored under it. Blocks are
        # counted in the selected block size, else in that of the namespace
        # holding the most of the prompt.
        candidates = [lk for lk, _ in others if lk.deployment in same_model] or [lk for lk, _ in others]
        block_size = found.selection.get("block_size") or (candidates[0].block_size if candidates else None)
        blocks = []
        max_blocks = 0
        if block_size:
            max_blocks = max(0, (num_tokens - 1) // block_size)
            blocks = [Block(i, i * block_size, (i + 1) * block_size, i < max_blocks, (), 1)
                      for i in range(num_tokens // block_size)]
        hit = 0
    first_miss = next((b for b in blocks if b.loadable and not b.stored), None)
    better = [(lk, diffs) for lk, diffs in others if lk.hit_tokens > hit * (block_size or 0)]

    def report(reason: str, message: str) -> Report:
        return Report(**vars(found), block_size=block_size, blocks=blocks, max_blocks=max_blocks,
                      stored_prefix_blocks=hit, first_miss=first_miss, reason=reason, message=message)

    if block_size and max_blocks == 0:
        return report("too_short", f"the prompt has no full block that a request could load "
                                   f"({plural(num_tokens, 'token')}, block size {block_size}): a request "
                                   f"computes at least its last token, and only full blocks are stored")
    where = (f"block {first_miss.index} (tokens {first_miss.start}-{first_miss.end - 1})" if first_miss
             else "the first block")
    if target is None:
        if better:
            lk, diffs = better[0]
            kind = "other_namespace" if lk.deployment in same_model else "other_model"
            what = "no namespace of this model" if not same_model else \
                "no namespace of this model with " + say_selection(found.selection)
            return report(kind, f"the store holds {what}; namespace {lk.deployment.digest.hex()[:16]} "
                                f"({lk.deployment.describe()}) would load {lk.hit_tokens} tokens of this "
                                f"prompt, but differs in {say_differences(diffs)}. Blocks are shared only "
                                f"within one namespace")
        if not same_model:
            models = {d.deployment.namespace.model_fingerprint for d, _ in others}
            return report("no_model", f"the store holds nothing for this model: no namespace manifest has its "
                                      f"fingerprint {found.model_fingerprint[:12]} (the store has manifests of "
                                      f"{plural(len(models), 'other model')}); no engine serving these weights "
                                      f"and config saved here, or its manifests were removed")
        chosen = say_selection(found.selection)
        return report("no_namespace", f"the store has {plural(len(same_model), 'namespace')} of this model, none "
                                      f"with {chosen or 'the --namespace given'}, and none of them holds this "
                                      f"prompt's first block either")
    min_hit_blocks = found.min_hit_blocks
    if first_miss is None:
        if target.leading_blocks > hit:
            return report("min_hit_blocks", f"{plural(target.leading_blocks, 'leading block')} are stored, fewer "
                                            f"than --min-hit-blocks {min_hit_blocks}: the connector computes "
                                            f"them instead of loading them")
        return report("full_hit", f"every block a request could load is stored: it would load {hit * block_size} "
                                  f"tokens and compute the last {num_tokens - hit * block_size}")
    below_min = (f" (and the {plural(target.leading_blocks, 'leading block')} before it are fewer than "
                 f"--min-hit-blocks {min_hit_blocks}, so none is loaded)"
                 if 0 < target.leading_blocks < min_hit_blocks else "")
    if first_miss.stored_ranks:
        return report("tp_shard_missing",
                      f"{where} is stored for TP rank {', '.join(map(str, first_miss.stored_ranks))} but not for "
                      f"rank {', '.join(map(str, first_miss.missing_ranks))} of {first_miss.tp_size}: a request "
                      f"loads a block only when every rank's shard is there; the missing shards were evicted, "
                      f"deleted or never written{below_min}")
    later = [b for b in blocks[first_miss.index + 1:] if b.stored_ranks]
    if later:
        return report("evicted", f"{where} is not stored, but later block {later[0].index} of this prompt is: "
                                 f"it was saved once and has since been evicted or deleted (a bigger store, "
                                 f"or Redis's allkeys-lru, keeps more){below_min}")
    for alt in found.alternatives:
        if alt.hit_tokens > target.hit_tokens:
            missing = [name for name, given, used in (("cache_salt", target.with_salt, alt.with_salt),
                                                      ("lora", target.with_lora, alt.with_lora))
                       if given and not used]
            what = " and ".join("the cache_salt given" if m == "cache_salt" else "the LoRA adapter given"
                                for m in missing)
            return report("_and_".join(missing),
                          f"{where} is not stored with {what}, but without it the store holds "
                          f"{plural(alt.hit_blocks, 'leading block')} ({alt.hit_tokens} tokens): the stored "
                          f"blocks were saved by requests without it, and a "
                          f"{'cache_salt' if missing[0] == 'cache_salt' else 'LoRA adapter'} changes every key"
                          f"{below_min}")
    if better:
        lk, diffs = better[0]
        kind = "other_namespace" if lk.deployment in same_model else "other_model"
        return report(kind, f"{where} is not stored under this namespace, but namespace "
                            f"{lk.deployment.digest.hex()[:16]} ({lk.deployment.describe()}) would load "
                            f"{lk.hit_tokens} tokens of this prompt; it differs in "
                            f"{say_differences(diffs)}. Blocks are shared only within one namespace{below_min}")
    if first_miss.index == 0:
        hint = ("" if found.cache_salt_given or found.lora is not None else
                "; if the requests carried a cache_salt or a LoRA adapter, give --cache-salt or --lora: "
                "they change every key")
        return report("diverges", f"{where} is not stored under this namespace or any other: no engine saved a "
                                  f"prompt that starts like this one, or it was evicted{hint}")
    return report("diverges", f"the prompt diverges at {where} from every prompt stored: blocks 0-"
                              f"{first_miss.index - 1} are stored, but no stored prompt continues with this "
                              f"block's tokens{below_min}")
