"""Run as a script: publish N versions of a drifting random state into a store (a concurrent writer).

With ``--gated`` the writer and its reader take turns by lines, not by timing: after queueing
each version the writer prints ``published <v>`` and waits for a line on stdin before it goes on.
The upload of that version runs meanwhile on the publisher's thread, so the reader's reads still
race real uploads."""

from __future__ import annotations

import sys

import torch

from shared.chain import AnchorPolicy
from shared.publisher import DeltaPublisher

if __name__ == "__main__":
    store, n = sys.argv[1], int(sys.argv[2])
    gated = "--gated" in sys.argv[3:]
    torch.manual_seed(0)
    state = {f"layer{i}.weight": (torch.randn(256, 256) * 0.02).bfloat16() for i in range(4)}
    with DeltaPublisher(state, store, policy=AnchorPolicy(max_deltas=5), keep_anchors=1000) as pub:
        for _ in range(n):
            for t in state.values():
                m = torch.rand(t.shape) < 0.01
                t[m] = (t[m].float() * 1.01).bfloat16()
            report = pub.publish()
            if gated:
                print(f"published {report.version}", flush=True)
                if not sys.stdin.readline():
                    sys.exit("the reader went away")
