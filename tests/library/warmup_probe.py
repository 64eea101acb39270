"""Run as a script in a fresh process: ``shared.warmup.warm()``, then a trainer's and a replica's
real work on a model unlike warm()'s; prints JSON: the kernel signatures warm() compiled (or
loaded) and those the real work added after it, which should be none."""

from __future__ import annotations

import json
import sys
import tempfile

import numba
import torch

from shared import fingerprint, kernels
from shared.apply import Patch, apply_delta, flat_bits, landed
from shared.chain import AnchorPolicy
from shared.codec import DeltaFile
from shared.fingerprint import GatherItem, GatherTarget, gather_updates, one_run, tensor_fingerprint
from shared.publisher import DeltaPublisher
from shared.stores import open_store
from shared.warmup import warm


def compiled() -> dict[str, set[str]]:
    found = {f"kernels.{n}": d for n, d in vars(kernels).items() if isinstance(d, numba.core.registry.CPUDispatcher)}
    found.update({f"fingerprint.{n}": d for n, d in fingerprint._kernels().items()})
    return {n: {str(s) for s in d.signatures} for n, d in found.items()}


def train(model: torch.nn.Module, steps: int) -> list[bytes]:
    """AdamW steps on fp32 master weights, each published as bf16; the delta files."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-5)
    with tempfile.TemporaryDirectory() as folder:
        with DeltaPublisher(model, folder, keep_anchors=10**6, policy=AnchorPolicy(catchup_fraction=1e9)) as pub:
            for _ in range(steps):
                model(torch.randn(8, 384)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                pub.publish().wait(600)
        store = open_store(folder)
        return [store.get(k) for k in sorted(store.list("deltas/"))]


def drift(state: dict[str, torch.Tensor], steps: int) -> list[bytes]:
    """bf16 weights moved in place (low bits of ~0.5%, and all of one big tensor's first rows),
    each version published; the delta files."""
    with tempfile.TemporaryDirectory() as folder:
        with DeltaPublisher(state, folder, keep_anchors=10**6, policy=AnchorPolicy(catchup_fraction=1e9)) as pub:
            for step in range(steps):
                for t in state.values():
                    bits = t.view(-1).view(torch.int16)
                    at = torch.randint(0, bits.numel(), (bits.numel() // 200 + 1,))
                    bits[at] ^= 1 + step % 3
                state["big"].view(-1)[:4096] += 1e-3
                pub.publish().wait(600)
        store = open_store(folder)
        return [store.get(k) for k in sorted(store.list("deltas/"))]


def replay(base: dict[str, torch.Tensor], deltas: list[bytes]) -> None:
    """A replica's work on each delta: decode, stage (gather), apply, read back, audit."""
    for data in deltas:
        delta = DeltaFile.from_bytes(data)
        changes = [c for c in delta.decode(base) if c is not None and c.positions is not None]
        staged = gather_updates([GatherItem(GatherTarget(flat_bits(base[c.name]), one_run(base[c.name].numel()),
                                                         base[c.name].numel()), c.positions, c.bits, c.mode)
                                 for c in changes])
        apply_delta(delta, base)
        assert all(landed([Patch(c.name, flat_bits(base[c.name]), g.dest, g.new, g.old)
                           for c, g in zip(changes, staged)]))
    for t in base.values():
        tensor_fingerprint(t)


if __name__ == "__main__":
    torch.manual_seed(1)
    warm()
    before = compiled()
    model = torch.nn.Sequential(torch.nn.Linear(384, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 384),
                                torch.nn.LayerNorm(384))
    start = {n: t.detach().to(torch.bfloat16).clone() for n, t in model.state_dict().items()}
    replay(start, train(model, 4))
    # over 2**25 elements: more possible changes than one batched scan takes, so scanned alone
    state = {"big": (torch.randn(1 << 25 | 1 << 22) * 0.02).bfloat16(), "small": (torch.randn(3000) * 0.02).bfloat16()}
    start = {n: t.clone() for n, t in state.items()}
    replay(start, drift(state, 3))
    after = compiled()
    json.dump({"warmed": sum(map(len, before.values())),
               "added": {n: sorted(after[n] - before.get(n, set())) for n in after if after[n] - before.get(n, set())}},
              sys.stdout)
