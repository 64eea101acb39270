"""Keep vLLM's CPU linear layers computing from their plain ``weight`` parameters.

On CPU, vLLM 0.32 hands every unquantized linear layer (and the LM head) to a packed GEMM
backend after loading (oneDNN here; sgl/AMX or zentorch elsewhere): the kernel works on a packed
copy, and for linear layers ``layer.weight`` is replaced by an empty parameter. Writing new
values into the parameters then changes nothing that generation reads, silently. Measured on
this machine's EPYC with the tiny Qwen3: even with the weight kept, oneDNN ignores in-place edits.

For a replica that patches weights in place, the layers must read the live parameter. This
module swaps the dispatch for a plain ``torch.nn.functional.linear`` over ``layer.weight``. It is
installed in the engine process by importing :mod:`rollout_space.worker` (vLLM imports the
worker extension before it loads the model). On GPU nothing is packed and nothing is changed.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("rollout_space.cpu_weights")
_INSTALLED = False


def _plain_linear(layer: torch.nn.Module, remove_weight: bool = False) -> None:  # noqa: ARG001
    """Replacement for ``dispatch_cpu_unquantized_gemm``: compute from the live parameter."""
    layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)


def keep_plain_cpu_weights() -> bool:
    """Install the plain-weight dispatch once per process; True if it is (now) active."""
    global _INSTALLED
    if _INSTALLED:
        return True
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    import vllm.model_executor.layers.utils as layer_utils

    # vLLM's callers import the function from this module at call time, so patching the module
    # attribute reaches all of them (linear layers and the vocab-parallel LM head).
    layer_utils.dispatch_cpu_unquantized_gemm = _plain_linear
    _INSTALLED = True
    log.info("CPU linear layers will compute from their live weight parameters (no packing)")
    return True
