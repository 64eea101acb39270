"""What trl's AsyncGRPOTrainer needs to train without CUDA (applied only when CUDA is absent).

trl 1.16 assumes a GPU in two places, both reached from ``AsyncGRPOTrainer.__init__`` or its
forward pass, with no public switch:

1. ``get_peak_flops_per_device`` calls ``torch.cuda.get_device_name``, which asserts on a CPU
   build. Without CUDA there is no peak to report, so MFU is off (trl's own answer for an
   unknown device is ``None``).
2. The trainer loads the model with ``attn_implementation="tree_fa3"``, whose packed attention
   fetches FlashAttention-3 through ``kernels`` (CUDA only, downloaded from the Hub). The
   kernel is looked up through one cached function, ``packing._flash_attn``; on CPU it returns
   :class:`TorchVarlenAttention`, the same varlen causal attention in plain torch.

Each patched name is checked before it is replaced, so a trl upgrade that moves one fails here
with a clear message (and ``tests/trainer/test_cpu_shims.py`` notices) instead of deep inside
training. A model whose chat template trl does not know (trl's ``add_response_schema``) is not
shimmed: the locally built models carry trl's own Qwen3 template (``trainer_space.local``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SHIMMED = ("trl.experimental.async_grpo.async_grpo_trainer.get_peak_flops_per_device",
           "trl.experimental.async_grpo.packing._flash_attn")


class TorchVarlenAttention:
    """FlashAttention's ``flash_attn_varlen_func`` contract in plain torch, for CPU.

    Sequences are packed along the first dimension and delimited by cumulative lengths; a query
    block may be shorter than its key block (tree packing shares a prefix), in which case the
    causal mask is aligned to the bottom right, as FlashAttention aligns it.
    """

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                               softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0, **_):
        if softcap:
            raise NotImplementedError("softcap is not supported by the CPU attention shim")
        out = torch.zeros_like(q)
        rep = q.shape[1] // k.shape[1]
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for (qs, qe), (ks, ke) in zip(zip(cq, cq[1:]), zip(ck, ck[1:])):
            lq, lk = qe - qs, ke - ks
            if lq == 0 or lk == 0:
                continue
            qi = q[qs:qe].transpose(0, 1)
            ki = k[ks:ke].transpose(0, 1).repeat_interleave(rep, 0)
            vi = v[ks:ke].transpose(0, 1).repeat_interleave(rep, 0)
            i = torch.arange(lq).unsqueeze(1) + (lk - lq)
            j = torch.arange(lk).unsqueeze(0)
            allowed = (j <= i) if causal else torch.ones(lq, lk, dtype=torch.bool)
            if window_size[0] >= 0:
                allowed &= j >= i - window_size[0]
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=allowed, scale=softmax_scale)
            out[qs:qe] = o.transpose(0, 1).to(out.dtype)
        return out


def _no_peak_flops(accelerator, dtype):
    return None


def _torch_attention():
    return TorchVarlenAttention


def apply() -> list[str]:
    """Install the CPU shims when CUDA is absent; returns the names replaced (none on a GPU)."""
    if torch.cuda.is_available():
        return []
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    for module, name in ((async_grpo_trainer, "get_peak_flops_per_device"), (packing, "_flash_attn")):
        if not callable(getattr(module, name, None)):
            raise RuntimeError(f"trl changed: {module.__name__}.{name} is gone, so the CPU shim for it "
                               "no longer applies; see trainer_space/cpu_shims.py")
    async_grpo_trainer.get_peak_flops_per_device = _no_peak_flops
    packing._flash_attn = _torch_attention
    return list(SHIMMED)
