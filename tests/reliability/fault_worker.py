"""A worker extension that stops dead at one point of an update, so a test can kill the rollout
there deterministically instead of guessing a moment.

Named with ``--worker-extension-cls reliability.fault_worker.FaultWorkerExtension`` (the server
needs ``tests/`` on its PYTHONPATH). With ``DELTASYNC_TEST_HOLD`` set to one of :data:`POINTS` and
``DELTASYNC_TEST_HOLD_FILE`` to a path, the worker (in the engine core process) writes that file,
``{"point": ..., "pid": ...}``, when it reaches the point, and then blocks until it is killed:

- ``stage``: a staging job has started (background thread; generation goes on, nothing written);
- ``write``: inside the paused write, after the worker wrote the new bits and before the server
  hears of it (generation is paused; the weights are the new version's, the server still names
  the old one);
- ``audit``: the post-write audit has started (generation has resumed on the new version).

Without ``DELTASYNC_TEST_HOLD`` it behaves exactly as :class:`DeltaWorkerExtension`.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from rollout_space.worker import DeltaWorkerExtension

HOLD_ENV, HOLD_FILE_ENV = "DELTASYNC_TEST_HOLD", "DELTASYNC_TEST_HOLD_FILE"
POINTS = ("stage", "write", "audit")
QUALNAME = "reliability.fault_worker.FaultWorkerExtension"


def _hold(point: str) -> None:
    if os.environ.get(HOLD_ENV) != point:
        return
    marker = Path(os.environ[HOLD_FILE_ENV])
    tmp = marker.with_name(marker.name + ".tmp")
    tmp.write_text(json.dumps({"point": point, "pid": os.getpid()}))
    tmp.replace(marker)  # the test never reads a half-written marker
    threading.Event().wait()  # until SIGKILL


class FaultWorkerExtension(DeltaWorkerExtension):
    def _job_stage(self, job: str, arg: str) -> str:
        _hold("stage")
        return super()._job_stage(job, arg)

    def deltasync_write(self, stage: str) -> str:
        result = super().deltasync_write(stage)
        _hold("write")
        return result

    def _job_audit(self, job: str, stage: str) -> str:
        _hold("audit")
        return super()._job_audit(job, stage)
