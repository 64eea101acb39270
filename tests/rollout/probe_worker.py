"""A worker extension for tests: one linear layer computes from a private copy of its weight.

This is what a packing backend does (oneDNN on CPU keeps a packed copy made at load time): the
parameter stays, writes into it land and read back exactly, but the layer's output never sees
them. The server takes it with ``--worker-extension-cls probe_worker.PrivateCopyExtension``
(``tests/rollout`` on the server's PYTHONPATH); ``DELTASYNC_TEST_PRIVATE_COPY`` names the module.
"""

from __future__ import annotations

import os

import torch

from rollout_space.worker import DeltaWorkerExtension

MODULE_ENV = "DELTASYNC_TEST_PRIVATE_COPY"


class PrivateCopyExtension(DeltaWorkerExtension):
    def deltasync_init(self, arg: str) -> str:
        result = super().deltasync_init(arg)  # the map and the real weights first (probing overwrites)
        module = self._ds_model().get_submodule(os.environ[MODULE_ENV])
        private = module.weight.detach().clone()  # made once, like a packed copy at load time

        def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return torch.nn.functional.linear(x, private, bias)

        module.cpu_linear = linear
        return result
