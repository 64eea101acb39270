"""Small state builders for the shared/ tests."""

from __future__ import annotations

import torch


def bits_state(seed: int, specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """Random bit patterns (so NaN payloads, infinities, -0 and subnormals all occur)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in specs.items():
        n = 1
        for d in shape:
            n *= d
        raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
        out[name] = raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)
    return out


def perturb(state: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """A copy where about ``fraction`` of each tensor's elements get new random bits."""
    g = torch.Generator().manual_seed(seed)
    new = {}
    for name, t in state.items():
        t = t.clone()
        flat = t.view(-1).view(torch.uint8).view(-1, t.element_size()) if t.numel() else None
        if flat is not None:
            mask = torch.rand(t.numel(), generator=g) < fraction
            k = int(mask.sum())
            flat[mask] = torch.randint(0, 256, (k, t.element_size()), dtype=torch.uint8, generator=g)
        new[name] = t
    return new


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[n].shape == b[n].shape and a[n].dtype == b[n].dtype
        and torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8))
        for n in a)


def adamw_steps(model: torch.nn.Module, steps: int, lr: float, seed: int = 0):
    """Real-gradient steps: next-token loss on random token ids."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    vocab = model.config.vocab_size
    for _ in range(steps):
        ids = torch.randint(0, vocab, (4, 32), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        yield
