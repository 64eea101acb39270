"""trl's weight-transfer protocol over DeltaSync: every sync becomes one exact version in a store.

``AsyncGRPOTrainer(weight_transfer=DeltaSyncTransfer(...))`` replaces trl's NCCL group (which
cannot cross Spaces: a Space reaches another only over HTTPS) with a bf16 delta uploaded to the
store and a ``POST /update`` to every replica. trl calls, on its main process:
``init_weight_transfer()`` once, then ``pause() / send_weights(iterator) / resume()`` once cold and
after every ``weight_sync_steps`` optimizer steps, then ``destroy()``.

Versions line up with trl's counter: version 0 is the base checkpoint every replica loads
(nothing uploaded), the cold sync publishes version 1, and so on, so ``model_version`` in trl's
samples, the chain's version and a replica's ``policy_version`` are one number.

trl tags each rollout group with its ``model_version`` when generation starts and bumps the
counter right after ``resume()``. ``resume()`` therefore returns only once every replica answers
that it serves the new version, so a sample is never counted under a newer policy than the one
that produced it; a replica that cannot reach the version stops training with
:class:`ReplicaLagError` rather than mislabel samples. Generation is never paused for the
upload: ``pause()`` is a no-op and each replica pauses only for its in-place write.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import torch

from shared.process import wait_healthy
from shared.publisher import BUSY_FRACTION, DeltaPublisher, PublishError, PublishReport


class ReplicaLagError(RuntimeError):
    """A replica did not confirm the version just published."""


class DeltaSyncTransfer:
    """trl's ``WeightTransferProtocol`` implemented with :class:`shared.publisher.DeltaPublisher`.

    ``base`` is the checkpoint the replicas were started on (a folder or Hub id): version 0.
    ``on_report`` sees every finished version (uploaded and announced, or failed), from the
    upload thread; the monitoring UI is such a callback. ``after_sync(version)`` runs in
    ``resume()`` once every replica serves the version (e.g. to check their live digests).
    """

    def __init__(self, store: str, replicas: Sequence[str], *, base: str, token: str | None = None,
                 ready_timeout_s: float = 600.0, compact: bool = False, digests: str = "every",
                 copy_from: float = BUSY_FRACTION, on_report: Callable[[PublishReport], None] | None = None,
                 after_sync: Callable[[int], None] | None = None):
        self.store, self.replicas, self.base, self.token = store, list(replicas), base, token
        self.ready_timeout_s, self.compact, self.digests, self.on_report = ready_timeout_s, compact, digests, on_report
        self.after_sync, self.copy_from = after_sync, copy_from
        self.publisher: DeltaPublisher | None = None
        self.timings: list[dict[str, float]] = []  # per sync: encode_s, wait_s (what trl waited in resume)
        self._pending: PublishReport | None = None

    # ------------------------------------------------------------------ trl's protocol
    def init_weight_transfer(self) -> None:
        """Wait until every replica answers ``/health``: the first sync must reach them."""
        for url in self.replicas:
            wait_healthy(url, self.ready_timeout_s)

    def pause(self) -> None:
        """Nothing to do: replicas keep generating while the delta is encoded and uploaded."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Encode what changed since the last version; upload and notify in the background."""
        state = dict(iterator)
        if self.publisher is None:
            # The first (cold) sync: the trainer holds the base checkpoint, which is version 0.
            self.publisher = DeltaPublisher(state, self.store, replicas=self.replicas, token=self.token,
                                            external_base=self.base, compact=self.compact,
                                            digests=self.digests, copy_from=self.copy_from,
                                            on_report=self.on_report)
        self._pending = self.publisher.publish(state)

    def resume(self) -> None:
        """Return once every replica serves the version just sent (see the module docstring)."""
        assert self.publisher is not None and self._pending is not None, "resume() before send_weights()"
        t0 = time.perf_counter()
        report, self._pending = self._pending, None
        try:
            report.wait()
        except PublishError as e:
            raise ReplicaLagError(str(e)) from None
        self.timings.append({"version": report.version, "encode_s": report.encode_s,
                             "wait_s": time.perf_counter() - t0})
        behind = {url: answer for url, answer in report.replicas.items()
                  if answer.get("version") != report.version}
        if behind:
            raise ReplicaLagError(f"v{report.version} is not served by {sorted(behind)}: {behind}")
        if self.after_sync is not None:
            self.after_sync(report.version)

    def destroy(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
