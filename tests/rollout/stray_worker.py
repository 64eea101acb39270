"""A worker extension for tests: one stray write into the live weights behind the replica's back.

After the first delta it writes, the worker flips the lowest bit of one element of the checkpoint
tensor named by ``DELTASYNC_TEST_STRAY_TENSOR`` straight into the engine parameter that holds it,
as a buggy kernel or a bad DMA would. The read-back audit of that delta's own positions cannot see
it; the rolling audit must, within K versions. The server takes it with ``--worker-extension-cls
stray_worker.StrayWriteExtension`` (``tests/rollout`` on the server's PYTHONPATH).
"""

from __future__ import annotations

import json
import os

import torch

from rollout_space.worker import DeltaWorkerExtension

TENSOR_ENV = "DELTASYNC_TEST_STRAY_TENSOR"


class StrayWriteExtension(DeltaWorkerExtension):
    def deltasync_commit(self, stage: str) -> str:
        result = super().deltasync_commit(stage)
        if json.loads(result).get("ok") and not getattr(self, "_stray_done", False):
            self._stray_done = True
            live = self._ds().weights.live
            (placement,) = live.locate(os.environ[TENSOR_ENV], torch.tensor([0]))
            bits = live.flats[placement.param].view(torch.int16)
            bits[placement.dest] ^= 1
        return result
