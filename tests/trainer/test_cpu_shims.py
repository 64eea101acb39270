"""The CPU shims: they still patch what trl calls, and the torch attention equals plain attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer_space import cpu_shims


def test_shims_replace_the_names_trl_still_uses():
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    # If trl renames or inlines these, the shims would silently stop applying: fail here instead.
    assert callable(async_grpo_trainer.get_peak_flops_per_device) and callable(packing._flash_attn)
    assert "_flash_attn().flash_attn_varlen_func" in __import__("inspect").getsource(packing.tree_attention)
    assert cpu_shims.apply() == list(cpu_shims.SHIMMED)
    assert async_grpo_trainer.get_peak_flops_per_device(None, "float32") is None
    assert packing._flash_attn() is cpu_shims.TorchVarlenAttention


def reference(q, k, v):
    """One sequence, full causal attention with bottom-right alignment, GQA by repetition."""
    lq, lk = q.shape[0], k.shape[0]
    rep = q.shape[1] // k.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(rep, 1)) / q.shape[-1] ** 0.5
    mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
    return torch.einsum("hqk,khd->qhd", F.softmax(scores.masked_fill(~mask, float("-inf")), -1),
                        v.repeat_interleave(rep, 1))


def test_varlen_attention_matches_per_sequence_reference():
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 16
    q_lens, k_lens = [5, 3, 7], [5, 8, 7]  # the second query block is a suffix of its keys (tree packing)
    q = torch.randn(sum(q_lens), heads, dim)
    k = torch.randn(sum(k_lens), kv_heads, dim)
    v = torch.randn(sum(k_lens), kv_heads, dim)
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    out = cpu_shims.TorchVarlenAttention.flash_attn_varlen_func(q, k, v, cu(q_lens), cu(k_lens), causal=True)
    qs, ks = cu(q_lens).tolist(), cu(k_lens).tolist()
    for i in range(3):
        want = reference(q[qs[i]:qs[i + 1]], k[ks[i]:ks[i + 1]], v[ks[i]:ks[i + 1]])
        torch.testing.assert_close(out[qs[i]:qs[i + 1]], want, rtol=1e-5, atol=1e-5)
