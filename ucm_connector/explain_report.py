"""``ucm explain``'s report, and its two forms: text for a person, one JSON
object (``--json``) for a script.

Owns ``Findings`` (what the command found) and ``Report`` (the findings
and the verdict drawn from them), the report's ``to_dict`` (a contract with
scripts: keys are only ever added) and its ``render``: a header, the
prompt's blocks in runs of the same status, the hit, the first miss and the
reason, notes, and the other namespaces.

What it must not do: open a store, look anything up or decide a reason
(``explain_reasons.py`` does), or print: ``explain.run`` prints what this
returns.  The store URL it is given is already masked, and no cache_salt
value reaches it.
"""

from __future__ import annotations

import dataclasses

from .cli.output import plural
from .explain_lookup import Block, Deployment, Lookup, say_differences, say_selection


@dataclasses.dataclass
class Findings:
    """What ``explain.explain`` found in the store about the prompt."""

    store: str                          # masked
    model: str
    model_fingerprint: str
    num_tokens: int
    cache_salt_given: bool
    lora: str | None
    min_hit_blocks: int
    selection: dict                     # the namespace fields the user selected
    target: Lookup | None               # under this engine's namespace, if the store has one
    others: list[tuple[Lookup, list[dict]]]       # every other namespace, and how it differs
    alternatives: list[Lookup]                    # the target without the salt / the adapter
    same_model: list[Deployment]                  # the namespaces of this model
    notes: list[str]


@dataclasses.dataclass
class Report(Findings):
    """The findings, and the verdict ``explain_reasons.conclude`` drew from them."""

    block_size: int | None
    blocks: list[Block]                 # the prompt's full blocks under the target (or counted as if)
    max_blocks: int                     # the scheduler's cap
    stored_prefix_blocks: int           # what a request would load
    first_miss: Block | None
    reason: str
    message: str

    @property
    def hit_tokens(self) -> int:
        return self.stored_prefix_blocks * (self.block_size or 0)

    def to_dict(self) -> dict:
        def lookup_dict(lk: Lookup) -> dict:
            return {"stored_prefix_blocks": lk.hit_blocks, "hit_tokens": lk.hit_tokens,
                    "block_size": lk.block_size, "stored_tokens": lk.held_tokens,
                    "with_cache_salt": lk.with_salt, "with_lora": lk.with_lora}

        return {
            "store": self.store,
            "model": self.model,
            "model_fingerprint": self.model_fingerprint,
            "num_tokens": self.num_tokens,
            "with_cache_salt": self.cache_salt_given,
            "lora": self.lora,
            "selection": self.selection,
            "namespace": self.target.deployment.to_dict() if self.target else None,
            "block_size": self.block_size,
            "blocks": [b.to_dict() for b in self.blocks],
            "loadable_blocks": self.max_blocks,
            "stored_prefix_blocks": self.stored_prefix_blocks,
            "hit_tokens": self.hit_tokens,
            "first_miss": None if self.first_miss is None else
            {"index": self.first_miss.index, "start": self.first_miss.start, "end": self.first_miss.end},
            "reason": self.reason,
            "message": self.message,
            "other_namespaces": [{**lk.deployment.to_dict(), **lookup_dict(lk),
                                  "same_model": lk.deployment.namespace.model_fingerprint == self.model_fingerprint,
                                  "differences": diffs} for lk, diffs in self.others],
            "alternatives": [lookup_dict(lk) for lk in self.alternatives],
            "notes": self.notes,
        }

    def render(self) -> str:
        lines = [f"store {self.store} (read-only)",
                 f"model {self.model} (fingerprint {self.model_fingerprint[:12]}), prompt of "
                 f"{plural(self.num_tokens, 'token')}"
                 + (", with a cache_salt" if self.cache_salt_given else "")
                 + (f", LoRA adapter {self.lora}" if self.lora else "")]
        if self.target is not None:
            lines.append(f"namespace {self.target.deployment.digest.hex()[:16]}  "
                         f"{self.target.deployment.describe()}")
        else:
            chosen = say_selection(self.selection)
            lines.append("namespace: none in the store" + (f" with {chosen}" if chosen else ""))
        if self.blocks:
            lines += ["", f"{'BLOCKS':<12}  {'TOKENS':<15}  STORED"]
            for first, last, status in _runs(self.blocks, self.first_miss):
                span = str(first.index) if first is last else f"{first.index}-{last.index}"
                lines.append(f"{span:<12}  {f'{first.start}-{last.end - 1}':<15}  {status}")
        if self.block_size and self.num_tokens % self.block_size:
            tail = self.num_tokens - self.num_tokens % self.block_size
            lines.append(f"{'':<12}  {f'{tail}-{self.num_tokens - 1}':<15}  "
                         f"(partial block: always computed, never stored)")
        lines.append("")
        if self.hit_tokens:
            lines.append(f"a request would load {plural(self.stored_prefix_blocks, 'block')} "
                         f"({self.hit_tokens} of {self.num_tokens} tokens) and compute the other "
                         f"{self.num_tokens - self.hit_tokens}")
        else:
            lines.append(f"a request would load nothing and compute all {plural(self.num_tokens, 'token')}")
        if self.first_miss is not None:
            lines.append(f"first miss: block {self.first_miss.index} (tokens {self.first_miss.start}-"
                         f"{self.first_miss.end - 1})")
        lines.append(f"reason: {self.reason}: {self.message}")
        for note in self.notes:
            lines.append(f"note: {note}")
        if self.others:
            lines += ["", "other namespaces in the store:"]
            for lk, diffs in self.others:
                lines.append(f"  {lk.deployment.digest.hex()[:16]}  {lk.deployment.describe()}")
                lines.append(f"      would load {plural(lk.hit_blocks, 'block')} ({lk.hit_tokens} tokens); "
                             f"differs in {say_differences(diffs)}")
        return "\n".join(lines) + "\n"


def _status(block: Block, first_miss: Block | None) -> str:
    if block.stored:
        text = "yes" if block.loadable else "yes (not loaded: a request computes its last token)"
    elif block.stored_ranks:
        text = f"no: rank {', '.join(map(str, block.missing_ranks))} missing"
    else:
        text = "no"
    if first_miss is not None and block.index == first_miss.index:
        text += "   <- first miss"
    return text


def _runs(blocks: list[Block], first_miss: Block | None):
    """Consecutive blocks of the same status, as (first, last, status)."""
    out = []
    for block in blocks:
        status = _status(block, first_miss)
        if out and out[-1][2] == status and "first miss" not in status:
            out[-1][1] = block
        else:
            out.append([block, block, status])
    return out
