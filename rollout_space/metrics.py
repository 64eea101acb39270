"""Prometheus metrics of the replica (served at ``GET /metrics`` beside vLLM's own)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from shared.schemas import StepReport

_TIMES = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)

VERSION = Gauge("deltasync_policy_version", "Policy version the replica serves (-1: base model)")
APPLIED = Counter("deltasync_updates_applied_total", "Objects applied", ["kind"])
REFUSED = Counter("deltasync_updates_refused_total", "Updates refused, by reason", ["reason"])
DOWNLOAD_BYTES = Counter("deltasync_download_bytes_total", "Bytes downloaded from the store")
DOWNLOAD_SECONDS = Histogram("deltasync_download_seconds", "Download and manifest check", buckets=_TIMES)
STAGE_SECONDS = Histogram("deltasync_stage_seconds", "Decode, gather, predict (while serving)",
                          buckets=_TIMES)
DRAIN_SECONDS = Histogram("deltasync_drain_seconds", "Waiting for in-flight requests before a write",
                          buckets=_TIMES)
PAUSE_SECONDS = Histogram("deltasync_apply_pause_seconds", "Generation stopped for the write",
                          buckets=_TIMES)
APPLY_SECONDS = Histogram("deltasync_apply_seconds", "The write inside the engine", buckets=_TIMES)
AUDIT_SECONDS = Histogram("deltasync_audit_seconds", "Read-back check after the write: the parameters hold the "
                          "target bits (not that generation reads them: see deltasync_write_probe_*)",
                          buckets=_TIMES)
AUDIT_PERIOD = Gauge("deltasync_audit_period_versions", "K: the rolling audit re-reads every tensor's whole "
                     "fingerprint once per K versions (--audit-every)")
ROLLING_AUDITED = Counter("deltasync_rolling_audit_tensors_total", "Whole tensors the rolling audit re-read")
ROLLING_DRIFTED = Counter("deltasync_rolling_audit_mismatches_total", "Tensors the rolling audit found not to "
                          "hold the version served (the replica is then marked damaged)")
RANKS = Gauge("deltasync_engine_ranks", "Engine ranks (tensor parallel size): each stages, writes and audits "
              "only its own shard")
SPLIT_TENSORS = Gauge("deltasync_split_tensors", "Checkpoint tensors held in parts by several ranks: their "
                      "partial fingerprints must add up before any rank writes")
CHANGED = Counter("deltasync_changed_elements_total", "Elements written by deltas")
DIGESTS = Counter("deltasync_live_digests_total", "Live state digests computed (GET /weights/digest "
                  "answers the others from its cache)")
DIGEST_SECONDS = Histogram("deltasync_live_digest_seconds", "One live state digest (tensors held in parts are "
                           "put together from every rank)",
                           buckets=_TIMES)
WRITE_PROBES = Counter("deltasync_write_probes_total", "Write-through probes (a perturbed parameter must move a "
                       "fixed prompt's logprobs, restoring it must restore them), by outcome: passed, failed, "
                       "inconclusive (the prompt was not deterministic)", ["outcome"])
WRITE_PROBE_SECONDS = Histogram("deltasync_write_probe_seconds", "One write-through probe, generation held",
                                buckets=_TIMES)
WRITE_PROBE_FAILED = Gauge("deltasync_write_probe_failed_params", "Parameters whose writes did not reach the "
                           "output in the last write-through probe")

VERSION.set(-1)


def observe_rolling_audit(audited: int, drifted: int) -> None:
    ROLLING_AUDITED.inc(audited)
    ROLLING_DRIFTED.inc(drifted)


def observe_step(step: StepReport) -> None:
    APPLIED.labels(kind=step.kind).inc()
    STAGE_SECONDS.observe(step.stage_s)
    DRAIN_SECONDS.observe(step.drain_s)
    PAUSE_SECONDS.observe(step.pause_s)
    APPLY_SECONDS.observe(step.write_s)
    if step.kind == "delta":
        AUDIT_SECONDS.observe(step.audit_s)
        CHANGED.inc(step.changed)
