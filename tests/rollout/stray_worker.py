"""Worker extensions for tests: the live weights changed behind the replica's back.

``StrayWriteExtension``: after the first delta it writes, the worker flips the lowest bit of one element of the checkpoint
tensor named by ``DELTASYNC_TEST_STRAY_TENSOR`` straight into the engine parameter that holds it,
as a buggy kernel or a bad DMA would. The read-back audit of that delta's own positions cannot see
it; the rolling audit must, within K versions. The server takes it with ``--worker-extension-cls
stray_worker.StrayWriteExtension`` (``tests/rollout`` on the server's PYTHONPATH).

``RebindExtension``: right after the first delta is written (before its audit), the module that
holds the engine parameter named by ``DELTASYNC_TEST_REBIND_PARAM`` gets a new parameter object
with the same values, as a layer that re-creates its weights would (a reload, a re-quantization):
generation then computes from the new one while writes through the replica's map land in the old.
The read-back audit must refuse that delta and take it back.
"""

from __future__ import annotations

import json
import os

import torch

from rollout_space.worker import DeltaWorkerExtension

TENSOR_ENV = "DELTASYNC_TEST_STRAY_TENSOR"
REBIND_ENV = "DELTASYNC_TEST_REBIND_PARAM"


class StrayWriteExtension(DeltaWorkerExtension):
    def deltasync_write(self, stage: str) -> str:
        result = super().deltasync_write(stage)
        if json.loads(result).get("ok") and not getattr(self, "_stray_done", False):
            self._stray_done = True
            live = self._ds().weights.live
            (placement,) = live.locate(os.environ[TENSOR_ENV], torch.tensor([0]))
            bits = live.flats[placement.param].view(torch.int16)
            bits[placement.dest] ^= 1
        return result


class RebindExtension(DeltaWorkerExtension):
    def deltasync_write(self, stage: str) -> str:
        result = super().deltasync_write(stage)
        if json.loads(result).get("ok") and not getattr(self, "_rebound", False):
            self._rebound = True
            path, _, leaf = os.environ[REBIND_ENV].rpartition(".")
            module = self._ds_model().get_submodule(path)
            setattr(module, leaf, torch.nn.Parameter(getattr(module, leaf).data.clone(), requires_grad=False))
        return result
