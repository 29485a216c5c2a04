"""Patches of the model runners' ``execute_model``: the step hook.

Before each step's forward, the method is told which requests start (with
the blocks they found already filled: prefix-cache hits and KV-connector
loads), which finish, and which blocks vLLM copies, as a ``StepInfo``.
``CPUModelRunner`` inherits ``execute_model`` from the V1 ``GPUModelRunner``,
so one patch covers both.  On CUDA, vLLM (0.32 on) builds its second model
runner (``vllm.v1.worker.gpu.model_runner``, not a subclass of the first)
unless told otherwise or a feature needs the first, so that one is patched
too; its dummy and profile runs (``dummy_run=True``) are no steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from . import _core
from ._core import Patch, fields_missing


def _all_groups(block_ids: Any) -> tuple[int, ...]:
    if not block_ids:
        return ()
    if len(block_ids) == 1:
        return tuple(block_ids[0])
    return tuple(b for group in block_ids for b in group)


def step_info(runner: Any, scheduler_output: Any):
    from ucm_connector.sparse.base import RequestStart, StepInfo

    started = [RequestStart(r.req_id, _all_groups(r.block_ids), r.num_computed_tokens)
               for r in scheduler_output.scheduled_new_reqs]
    cached = scheduler_output.scheduled_cached_reqs
    resumed = cached.resumed_req_ids
    if resumed:
        for i, req_id in enumerate(cached.req_ids):
            if req_id in resumed:
                started.append(RequestStart(req_id, _all_groups(cached.new_block_ids[i]),
                                            cached.num_computed_tokens[i]))
    copies = tuple((c.src_block_id, c.dst_block_id)
                   for c in (getattr(scheduler_output, "kv_cache_block_copies", None) or ()))
    scheduled = getattr(scheduler_output, "num_scheduled_tokens", None)
    return StepInfo(block_size=runner.cache_config.block_size, started=tuple(started),
                    finished_req_ids=frozenset(scheduler_output.finished_req_ids),
                    block_copies=copies,
                    scheduled_req_ids=frozenset(scheduled) if scheduled is not None else None)


def _make_execute_model(original: Callable) -> Callable:
    def execute_model(self, scheduler_output, *args, **kwargs):
        hooks = _core.hooks
        if hooks is not None and not kwargs.get("dummy_run"):
            _core.step_index += 1
            hooks.begin_step(step_info(self, scheduler_output))
        return original(self, scheduler_output, *args, **kwargs)

    return execute_model


def _check_output() -> list[str]:
    from vllm.v1.core.sched import output

    problems = fields_missing(output.SchedulerOutput, (
        "scheduled_new_reqs", "scheduled_cached_reqs", "finished_req_ids", "num_scheduled_tokens"))
    problems += fields_missing(output.NewRequestData, ("req_id", "block_ids", "num_computed_tokens"))
    problems += fields_missing(output.CachedRequestData, (
        "req_ids", "resumed_req_ids", "new_block_ids", "num_computed_tokens"))
    return problems


def _check(owner: Any) -> list[str]:
    problems = _check_output()
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError:
        CPUModelRunner = None
    if CPUModelRunner is not None and "execute_model" in vars(CPUModelRunner):
        problems.append("CPUModelRunner overrides execute_model; the patch of "
                        "GPUModelRunner.execute_model would not be called")
    return problems


EXECUTE_MODEL = Patch(
    name="model_runner.execute_model",
    module="vllm.v1.worker.gpu_model_runner",
    owner="GPUModelRunner",
    attr="execute_model",
    params=("self", "scheduler_output"),
    make=_make_execute_model,
    check_more=_check,
)


#: The same hook on vLLM's second runner (same class name, another module).
EXECUTE_MODEL_V2 = dataclasses.replace(EXECUTE_MODEL, name="model_runner_v2.execute_model",
                                       module="vllm.v1.worker.gpu.model_runner",
                                       check_more=lambda owner: _check_output())
