"""Run as a script: a trainer that publishes versions 1..N of :func:`states` into a local store and
is stopped (by the test's SIGKILL) with one upload in flight.

The store is the real local store with one gate: the write whose key contains ``--hold`` (after
skipping ``--skip`` earlier writes of that key) gets its complete temporary copy on disk, as the
real ``put``/``create`` make it, then prints ``holding <key> <temporary path>`` and blocks before
moving it into place. A kill there is a writer that died in the middle of an upload.

    python tests/reliability/publisher_proc.py STORE N --hold deltas/v00000005 [--skip K]
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a script: the repository root is not on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from shared.chain import AnchorPolicy
from shared.publisher import DeltaPublisher
from shared.stores import Store, open_store

POLICY = AnchorPolicy(max_deltas=3)  # anchors at v0, v3, v6, ...
SHAPES = {f"layer{i}.weight": (128, 128) for i in range(3)} | {"norm.weight": (128,)}
_STDOUT = threading.Lock()


def say(line: str) -> None:
    """One whole line to the test: the main thread and the uploader both talk, and print() writes
    the text and its newline apart, so unguarded lines can interleave ("queued v6holding ...")."""
    with _STDOUT:
        print(line, flush=True)


def states(n: int) -> list[dict[str, torch.Tensor]]:
    """The bf16 states of versions 0..n (about 1% of the elements change per version)."""
    g = torch.Generator().manual_seed(0)
    state = {k: (torch.randn(shape, generator=g) * 0.02).bfloat16() for k, shape in SHAPES.items()}
    out = [{k: t.clone() for k, t in state.items()}]
    for _ in range(n):
        for t in state.values():
            m = torch.rand(t.shape, generator=g) < 0.01
            t[m] = (t[m].float() * 1.01 + 1e-3).bfloat16()
        out.append({k: t.clone() for k, t in state.items()})
    return out


class GatedStore(Store):
    """The local store, blocked for good on one write after its temporary copy is complete."""

    def __init__(self, inner: Store, hold: str, skip: int):
        super().__init__(inner.fs, inner.root, inner.uri)
        self.hold, self.skip = hold, skip

    def _local_tmp(self, path: str, data: bytes | str | Path) -> str:
        tmp = super()._local_tmp(path, data)
        if self.hold in path:
            if self.skip == 0:
                say(f"holding {path[len(self.root) + 1:]} {tmp}")
                threading.Event().wait()  # until the test kills this process
            self.skip -= 1
        return tmp


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("versions", type=int)
    p.add_argument("--hold", required=True)
    p.add_argument("--skip", type=int, default=0)
    args = p.parse_args()
    wanted = states(args.versions)
    live = {k: t.clone() for k, t in wanted[0].items()}
    store = GatedStore(open_store(args.store), args.hold, args.skip)
    pub = DeltaPublisher(live, store, dtype=None, policy=POLICY, keep_anchors=1000, queue_size=1)
    for state in wanted[1:]:
        for k, t in live.items():
            t.copy_(state[k])
        say(f"queued v{pub.publish().version}")
    pub.close()  # never returns while an upload is held
    say("closed")


if __name__ == "__main__":
    main()
