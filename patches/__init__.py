"""Every monkey patch of vLLM lives in this package, and nowhere else.

``apply(hooks)`` routes vLLM's model-runner step and attention calls to a
sparse-attention method (``ucm_connector.sparse.SparseMethod``);
``revert()`` puts every original back.  Both are idempotent.  Before touching
anything, ``apply`` checks every patch it needs against the running vLLM:
the release series, and the shape of each target (its signature, the
metadata fields and ops the replacement reads).  If any check fails it
raises ``PatchError`` listing every problem, naming the vLLM version and the
patch, and patches nothing: never a half-patched engine.

Patches, one module per vLLM area:

* ``model_runner.execute_model``, and on CUDA ``model_runner_v2.execute_model``
  (vLLM's second model runner): the step hook (``model_runner.py``);
* ``cpu_attention.forward`` on the CPU platform, ``flash_attention.forward``
  on CUDA: the layer call hook (``attention.py``).

Apart from those, ``apply_connector_patches()`` installs what the connector
itself needs in every process (the plugin calls it): today one patch,
``MultiConnector.__init__`` (``multi_connector.py``), so that UCMConnector
as a MultiConnector child settles the load-failure policy vLLM reads.  It
never stops vLLM: a vLLM it does not fit gets a warning saying what to set
by hand.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from . import _core
from ._core import Patch, PatchError, vllm_version

__all__ = ["PatchError", "apply", "revert", "applied", "active_hooks", "patches_for_platform",
           "check", "vllm_version", "apply_connector_patches", "layers_not_reached", "example_batches"]

logger = logging.getLogger("vllm.ucm_connector.patches")
_lock = threading.Lock()
_installed: list[Patch] = []


def patches_for_platform() -> list[Patch]:
    """The patches this process needs: the step hook plus its platform's
    attention backend."""
    from vllm.platforms import current_platform

    from .attention import CPU_FORWARD, FLASH_ATTN_FORWARD
    from .model_runner import EXECUTE_MODEL, EXECUTE_MODEL_V2

    if current_platform.is_cpu():
        return [EXECUTE_MODEL, CPU_FORWARD]
    if current_platform.is_cuda():
        return [EXECUTE_MODEL, EXECUTE_MODEL_V2, FLASH_ATTN_FORWARD]
    raise PatchError(f"sparse attention patches support the CPU and CUDA platforms; "
                     f"this vLLM {vllm_version()} runs on {current_platform.device_name!r}")


def check(patches: list[Patch] | None = None) -> list[str]:
    """Every problem that would stop ``apply``; empty when it would succeed."""
    version = vllm_version()
    problems: list[str] = []
    for patch in patches if patches is not None else patches_for_platform():
        problems.extend(patch.problems(version))
    return problems


def apply(hooks: Any, patches: list[Patch] | None = None) -> None:
    """Route vLLM's step and attention calls to ``hooks``.

    Already applied: only the hooks are swapped.  ``patches`` defaults to
    ``patches_for_platform()``.
    """
    if hooks is None:
        raise ValueError("apply() needs the hooks to call; use revert() to go back to dense")
    with _lock:
        if _installed:
            _core.hooks = hooks
            return
        wanted = patches if patches is not None else patches_for_platform()
        problems = check(wanted)
        if problems:
            raise PatchError(
                f"ucm-connector cannot patch vLLM {vllm_version()} for sparse attention; nothing was "
                "patched:\n  - " + "\n  - ".join(problems)
                + "\nremove 'sparse' from kv_connector_extra_config to run dense, or use a supported vLLM")
        try:
            for patch in wanted:
                patch.install()
                _installed.append(patch)
        except BaseException:
            _revert_locked()
            raise
        _core.hooks = hooks
        logger.info("ucm-connector: sparse attention patches applied to vLLM %s: %s", vllm_version(),
                    ", ".join(p.name for p in wanted))


def _revert_locked() -> None:
    _core.hooks = None
    while _installed:
        _installed.pop().uninstall()
    from .attention import _CpuSchedule
    from .cpu_pages import forget

    _CpuSchedule.clear()
    forget()


def revert() -> None:
    """Put every patched vLLM function back; dense attention from the next call."""
    with _lock:
        _revert_locked()


def applied() -> bool:
    return bool(_installed)


def active_hooks() -> Any:
    return _core.hooks


def layers_not_reached(forward_context: dict[str, Any]) -> dict[str, str]:
    """The attention layers of a loaded model (vLLM's static forward
    context: layer name -> layer) whose backend's ``forward`` the layer call
    hook does not reach, by name, with their backend's class name: another
    backend (FlashInfer, an MLA one, Triton) or a subclass of a patched one
    that brings its own ``forward``.  Those layers stay dense.  A composite
    impl that hands decoder calls to a patched one is reached."""
    from .attention import hooked_impl

    missing = {}
    for name, layer in forward_context.items():
        impl = getattr(layer, "impl", None)
        if impl is not None and hooked_impl(impl) is None:
            missing[name] = type(impl).__name__
    return missing


def example_batches(forward_context: dict[str, Any], kv_caches: dict[str, Any], dtype: Any,
                    max_model_len: int) -> list[Any]:
    """One example call (``attention.example_batch``) per kind of attention
    layer the layer call hook reaches: layers alike in backend, head
    counts, head size and cache are one kind.  ``kv_caches``: layer name ->
    the cache vLLM registers with the connector."""
    from .attention import example_batch, hooked_impl

    examples: dict[tuple, Any] = {}
    for name, layer in forward_context.items():
        kv_cache = kv_caches.get(name)
        impl = hooked_impl(getattr(layer, "impl", None))
        if kv_cache is None or impl is None:
            continue
        kind = (type(impl), impl.num_heads, impl.num_kv_heads, impl.head_size, kv_cache.dtype,
                tuple(kv_cache.shape[1:]), kv_cache.stride())
        if kind not in examples:
            example = example_batch(name, layer, kv_cache, dtype, max_model_len)
            if example is not None:
                examples[kind] = example
    return list(examples.values())


def apply_connector_patches() -> bool:
    """Install the connector's own patches (idempotent); ``False``, with a
    warning, where this vLLM does not fit them."""
    from .multi_connector import MULTI_CONNECTOR_INIT

    with _lock:
        if MULTI_CONNECTOR_INIT.installed:
            return True
        problems = MULTI_CONNECTOR_INIT.problems(vllm_version())
        if problems:
            logger.warning("ucm-connector: %s; under MultiConnector, set kv_load_failure_policy to "
                           "'recompute' at the top level of --kv-transfer-config yourself", "; ".join(problems))
            return False
        MULTI_CONNECTOR_INIT.install()
        return True
