"""Run as a script: publish N versions of a drifting random state into a store (a concurrent writer)."""

from __future__ import annotations

import sys

import torch

from shared.chain import AnchorPolicy
from shared.publisher import DeltaPublisher

if __name__ == "__main__":
    store, n = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    state = {f"layer{i}.weight": (torch.randn(256, 256) * 0.02).bfloat16() for i in range(4)}
    with DeltaPublisher(state, store, policy=AnchorPolicy(max_deltas=5), keep_anchors=1000) as pub:
        for _ in range(n):
            for t in state.values():
                m = torch.rand(t.shape) < 0.01
                t[m] = (t[m].float() * 1.01).bfloat16()
            pub.publish()
