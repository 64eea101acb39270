"""The vLLM engine of one replica and the version it serves: start-up, catch-up and updates.

One ``AsyncLLM`` (its engine core and worker run in a child process) with the
:class:`~rollout_space.worker.DeltaWorkerExtension`. Every update follows the same steps:

1. plan the objects from the held version to the target (``shared.chain.Chain.plan``),
2. download and check each against its manifest (a thread; generation goes on),
3. stage it in the worker (background thread there; generation goes on),
4. pause the scheduler (``mode="wait"``: running requests finish on the old weights, new ones
   queue), write, label the engine's weight version, reset the prefix cache, resume,
5. audit the written tensors by reading them back (generation goes on); revert on mismatch.

The audit proves the parameters hold the target bits; it cannot tell whether generation computes
from them (see :mod:`rollout_space.live_weights`). That is the **write-through probe**
(:meth:`RolloutEngine.write_probe`), run at start-up before serving, on demand (``POST /probe``)
and, with ``--write-probe dense``, after every dense load while serving: with no other request
in the engine it runs a fixed prompt (prompt logprobs and one greedy token's, prefix cache not
read), then for each engine parameter a delta can write (all, or ``--write-probe-params K``
sampled) writes a perturbation through the delta's own write path, reruns the prompt and requires
the logprobs to change, writes the old bits back; at the end the prompt must give the first
run's logprobs bit for bit. A parameter whose perturbation leaves the output unchanged is one the
engine does not compute from: the replica is then damaged for good (generation and updates
refused with 503) since no update can fix it. Cost: 3 + (parameters checked) forwards of a
16-token prompt and two in-place writes of each checked parameter; the first two forwards check
that the prompt is deterministic (if not, the probe is ``inconclusive`` and changes nothing).

Each engine output carries the weight version label of the step that produced it, so every
response can say which policy version generated it, token span by token span.
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import json
import logging
import math
import os
import random
import tempfile
import time
import uuid
from argparse import Namespace
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from shared.chain import Chain, Manifest
from shared.codec import DeltaFile, read_header
from shared.digest import TORCH_DTYPES
from shared.errors import DeltaError
from shared.lock import process_alive
from shared.schemas import PauseMode, Refusal, StepReport, UpdateResponse
from shared.stores import open_store

from . import metrics
from .live_weights import DIGEST_PASSES, audit_hashes, check_shards, compare_live

log = logging.getLogger("rollout_space.engine")
EXTENSION = "rollout_space.worker.DeltaWorkerExtension"
BASE_LABEL = "base"  # weight version label before the chain names a version
DAMAGED_LABEL = "damaged"  # weights of no version (a failed dense load): no response names a version
PROBE_TOKENS = 16  # length of the write-through probe's prompt
PROBE_SEED = 20261129  # its token ids: a fixed draw from the vocabulary, the same on every replica
PROBE_HOLD_S = 120.0  # longest wait for in-flight requests before an on-demand probe is refused

# Per request: the weight-version spans of each finished choice, filled by the wrapped generate.
SPANS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("deltasync_spans", default=None)


def _raise_failed(answer: dict) -> None:
    """A worker's answer that says it failed, as the error it names."""
    if not answer.get("ok", False):
        if answer.get("reason", "internal") == "internal":
            raise RuntimeError(answer.get("message"))
        raise DeltaError(answer["reason"], answer.get("message", ""))


def _check_shards(answers: list[dict], what: str) -> None:
    """Refuse when the ranks' partial fingerprints of a tensor held in parts do not add up to
    its whole (``what``: what they were computed for, for the message)."""
    if bad := check_shards([a.get("shards", {}) for a in answers]):
        raise DeltaError("digest_mismatch", f"{what}: the ranks' parts of {len(bad)} tensor(s) do not add "
                         f"up to the expected fingerprint (e.g. {bad[0]})")


def _merge_audits(answers: list[dict]) -> dict:
    """One audit from every rank's: what any rank found wrong, the slowest rank's times."""
    out = dict(answers[0])
    for key in ("bad", "drifted"):
        out[key] = sorted({n for a in answers for n in a[key]})
    for key in ("audit_s", "rolling_s"):
        out[key] = max(a[key] for a in answers)
    return out


def _tensor_hashes_of(answers: list[dict], dtype: str, numel: int) -> tuple[str, str | None] | None:
    """A tensor's live (digest, fingerprint or None) from every rank's ``deltasync_tensor``
    answer, as :func:`~rollout_space.live_weights.compare_live` takes them: a copy that is not
    what is held wins over one that is (every copy must be); parts held by ranks are put
    together in checkpoint order (a gap or an overlap gives no digest at all). None: no rank
    holds it (a tied alias)."""
    held, declared = answers[0]["held"], answers[0]["declared"]
    found = [(a["digest"], a["fingerprint"]) for a in answers if "digest" in a]
    if any("runs" in a for a in answers):
        whole = _tensor_of(answers, dtype, numel)
        found.append(("", "") if whole is None else audit_hashes(whole, held))
    if not found:
        return None
    return next((h for h in found if ((h[0] != held) if held else (h[1] != declared))), found[0])


def _tensor_of(answers: list[dict], dtype: str, numel: int) -> torch.Tensor | None:
    """A tensor split across ranks put together, in checkpoint order, from the runs in every
    rank's ``deltasync_tensor`` answer; None if they leave a gap or overlap."""
    parts = [a for a in answers if "runs" in a]
    data = [base64.b64decode(a["data"]) for a in parts]
    size = sum(map(len, data)) // max(1, sum(n for a in parts for _, n in a["runs"]))
    whole = bytearray(numel * size)
    filled = 0
    for a, d in zip(parts, data):
        off = 0
        for start, n in a["runs"]:
            whole[start * size:(start + n) * size] = d[off:off + n * size]
            off, filled = off + n * size, filled + n
    if filled != numel:
        return None
    raw = torch.frombuffer(whole, dtype=torch.uint8) if whole else torch.empty(0, dtype=torch.uint8)
    return raw.view(TORCH_DTYPES[dtype])


def _runs_of_deltas(plan: list) -> list[list]:
    """Split a plan into anchors (alone) and runs of consecutive deltas."""
    groups: list[list] = []
    for ref in plan:
        if ref.kind == "delta" and groups and groups[-1][-1].kind == "delta":
            groups[-1].append(ref)
        else:
            groups.append([ref])
    return groups


class WriteThroughFailed(Exception):
    """A write into an engine parameter did not reach the output (the message says which)."""


class ProbeBusy(Exception):
    """The write-through probe cannot run now (generation paused by a user, requests did not end)."""


class Damaged(Exception):
    """A request waited at the gate while the write-through probe found the replica damaged: it
    is refused (503), like every request after it."""


def _drop_dead_downloads(work: Path) -> None:
    """Downloads are named ``<object>-<pid>``; a replica killed mid-update leaves its own behind
    (an anchor is as large as the model), so a new one removes those whose process is gone."""
    for f in work.glob("*-*.safetensors"):
        pid = f.stem.rpartition("-")[2]
        if pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)):
            log.info("removing %s, left by a replica process that is gone", f.name)
            f.unlink(missing_ok=True)


class UpdateRefused(Exception):
    """An update that was refused; ``response`` says what is served now and why."""

    def __init__(self, response: UpdateResponse):
        assert response.refused is not None
        super().__init__(f"{response.refused.reason}: {response.refused.message}")
        self.response = response


def label_of(version: int | None) -> str:
    return BASE_LABEL if version is None else str(version)


def version_of(label: str) -> int | None:
    """The version a weight label names; None for the base model and for weights of no version."""
    try:
        return int(label)
    except (TypeError, ValueError):
        return None


def resolve_model_dir(model: str) -> Path:
    """A local folder as is; a Hub id through the local Hugging Face cache (vLLM fetched it)."""
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, allow_patterns=["*.safetensors", "*.json"]))


@dataclass
class ReplicaState:
    version: int | None = None
    commitment: str = ""
    state_fingerprint: str = ""
    state_digest: str = ""  # blake3; "" when the version's manifest has none (digests="anchors")
    status: str = "starting"
    latest_seen: int | None = None
    history: list[dict] = field(default_factory=list)
    damage: str = ""  # why the replica is damaged (status "damaged")


class RolloutEngine:
    def __init__(self, args: Namespace):
        self.args = args
        self.state = ReplicaState()
        self.engine: Any = None
        self.chain: Chain | None = None
        self.model_dir: Path | None = None
        self.base_state_digest = ""
        self.world = 1  # engine ranks (tensor parallel size)
        self.specs: dict[str, list] = {}  # checkpoint tensor -> (dtype, shape), from the workers
        self.user_paused = False
        self._lock = asyncio.Lock()  # one update at a time
        self.write_lock = asyncio.Lock()  # paused sections vs user /pause and /resume
        self._work = Path(args.work_dir or tempfile.mkdtemp(prefix="rollout-space-"))
        self._work.mkdir(parents=True, exist_ok=True)
        _drop_dead_downloads(self._work)
        self.timings: dict[str, float] = {}
        # Live digests: one computation at a time, shared by every caller that asks meanwhile,
        # and the last result kept for as long as the weights it read stay unwritten.
        self.weight_writes = 0  # bumped before and after every write to the live weights
        self._digest: tuple[tuple, dict] | None = None  # (weights key, result)
        self._digest_task: tuple[tuple, asyncio.Task] | None = None  # (weights key, computation)
        # Write-through probe: the last report; a failure that no update can repair; the gate that
        # holds new generation requests while it runs, and the count of requests in the engine.
        self.write_probe_report: dict | None = None
        self.write_through_failure = ""
        self.serving = False  # set when start-up ends: later probes must hold generation
        self._gate = asyncio.Event()
        self._gate.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._active = 0
        self._raw_generate: Any = None

    # ------------------------------------------------------------------ start-up
    async def start(self) -> None:
        t0 = time.perf_counter()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        if getattr(self.args, "pipeline_parallel_size", 1) > 1:
            # Maps are per tensor-parallel rank; a pipeline stage holds only some layers.
            raise SystemExit("rollout_space supports pipeline parallel size 1 for now")
        # A subclass of ours (e.g. one that adds RPCs, or a test's fault points) may be named with vLLM's
        # own --worker-extension-cls; anything else would lose the deltasync_* methods.
        self.args.worker_extension_cls = self.args.worker_extension_cls or EXTENSION
        engine_args = AsyncEngineArgs.from_cli_args(self.args)
        vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        self.world = vllm_config.parallel_config.world_size
        self.engine = AsyncLLM.from_vllm_config(
            vllm_config=vllm_config, usage_context=UsageContext.OPENAI_API_SERVER,
            enable_log_requests=engine_args.enable_log_requests,
            disable_log_stats=engine_args.disable_log_stats)
        self._track_versions()
        self.timings["engine_s"] = time.perf_counter() - t0

        self.chain = Chain(open_store(self.args.store))
        self.model_dir = resolve_model_dir(self.args.model)
        map_cache = self.args.map_cache or str(Path.home() / ".cache" / "deltasync" / "maps")
        ranks = await self.rpc_all("deltasync_init", json.dumps({"model_dir": str(self.model_dir),
                                                                 "map_cache": map_cache,
                                                                 "audit_every": self.args.audit_every}))
        _check_shards(ranks, f"the engine's weights after loading {self.model_dir}")
        r = ranks[0]
        self.specs = r["specs"]
        metrics.RANKS.set(self.world)
        self.split = set(r["shards"])  # tensors held in parts by several ranks
        metrics.SPLIT_TENSORS.set(len(self.split))
        metrics.AUDIT_PERIOD.set(self.args.audit_every)
        self.timings.update(map_s=r["map_s"], map_built=float(r["map_built"]), init_digest_s=r["digest_s"])
        log.info("checkpoint map: %d tensors, %d runs, %s in %.2fs; ignored %s", r["tensors"], r["runs"],
                 "probed" if r["map_built"] else "from cache", r["map_s"], r["ignored"])
        self.base_state_digest = r["state_digest"]
        self.state.state_digest, self.state.state_fingerprint = r["state_digest"], r["state_fingerprint"]
        await self.engine.update_weight_version(BASE_LABEL)
        t1 = time.perf_counter()
        try:
            await self.catch_up()
        except UpdateRefused as e:  # serve what we hold; the poller and /update retry
            log.error("catch-up at start refused: %s", e)
        except Exception:  # noqa: BLE001 - e.g. the store is unreachable
            log.exception("catch-up at start failed; serving v%s", self.state.version)
        if self.state.status == "updating":
            self.state.status = "ready"
        self.timings["catchup_s"] = time.perf_counter() - t1
        if self.probe_mode != "off":  # before serving: nothing to hold
            try:
                await self.write_probe("start")
            except Exception:  # noqa: BLE001 - it could not run: the replica says it is damaged
                log.exception("the write-through probe at start-up could not run")
        self.serving = True
        self.timings["startup_s"] = time.perf_counter() - t0
        if self.state.status == "starting":
            self.state.status = "ready"
        log.info("ready at v%s (%s) after %.1fs", self.state.version, self.state.state_digest[:12],
                 self.timings["startup_s"])

    async def catch_up(self) -> UpdateResponse | None:
        """Move to the store's latest version (nothing to do when the store is empty)."""
        latest = await asyncio.to_thread(self.chain.latest)
        if latest is None:
            log.info("%s holds no version yet; serving the base model", self.args.store)
            return None
        return await self.update(latest.version)

    def _track_versions(self) -> None:
        """Record, per request, the weight-version spans the engine reports for each choice; hold
        new requests at the gate while the write-through probe runs, and count those in flight."""
        engine = self.engine
        generate = self._raw_generate = engine.generate

        async def iterate(args, kwargs, spans: dict | None):
            await self.wait_open()
            if self.write_through_failure:  # held at the gate while the probe found the damage
                raise Damaged(f"replica damaged: {self.write_through_failure}")
            self._active += 1
            self._idle.clear()
            try:
                async for out in generate(*args, **kwargs):
                    if spans is not None:
                        for c in out.outputs:
                            if c.finish_reason is not None and c.weight_versions is not None:
                                spans[c.index] = [(s.version, s.start, s.end) for s in c.weight_versions]
                    yield out
            finally:
                self._active -= 1
                if not self._active:
                    self._idle.set()

        def tracked(*args, **kwargs):
            # Read the collector when the call is made (in the request handler's context); a
            # streaming response iterates the generator later, from another task.
            return iterate(args, kwargs, SPANS.get())

        engine.generate = tracked

    async def stop(self) -> None:
        if self._digest_task is not None:
            self._digest_task[1].cancel()
        if self.engine is not None:
            self.engine.shutdown()

    # ------------------------------------------------------------------ worker calls
    async def rpc(self, method: str, *args: str) -> dict:
        """Call ``method`` on every rank; rank 0's answer (any rank's error is raised)."""
        return (await self.rpc_all(method, *args))[0]

    async def rpc_all(self, method: str, *args: str) -> list[dict]:
        """Call ``method`` on every rank; every rank's answer, in rank order."""
        parsed = [json.loads(r) for r in await self.engine.collective_rpc(method, args=args)]
        for p in parsed:
            _raise_failed(p)
        return parsed

    async def job(self, kind: str, arg: str = "") -> dict:
        """:meth:`job_all`, rank 0's answer."""
        return (await self.job_all(kind, arg))[0]

    async def job_all(self, kind: str, arg: str = "") -> list[dict]:
        """Run a background job in every rank and wait for all of them (polling). Every rank
        numbers its jobs in the order they are submitted, and each submission reaches every
        rank, so one id names the job on all of them."""
        ids = set(await self.engine.collective_rpc("deltasync_submit", args=(kind, arg)))
        if len(ids) != 1:
            raise RuntimeError(f"ranks gave different job ids: {sorted(ids)}")
        job = ids.pop()
        keep = "keep" if self.world > 1 else ""  # several ranks: take results once all are done
        delay = 0.002
        while True:
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
            polled = [json.loads(p) for p in await self.engine.collective_rpc("deltasync_poll", args=(job, keep))]
            if all(d.get("done") for d in polled):
                break
        if keep:
            polled = [json.loads(p) for p in await self.engine.collective_rpc("deltasync_poll", args=(job,))]
        for d in polled:
            _raise_failed(d)
        return polled

    # ------------------------------------------------------------------ updates
    async def update(self, target: int | None = None, mode: PauseMode = "wait") -> UpdateResponse:
        async with self._lock:
            if self.write_through_failure:  # writes would not reach generation: no update can help
                metrics.REFUSED.labels(reason="write_through").inc()
                resp = self._response(target, [], time.perf_counter())
                resp.refused = Refusal(reason="write_through", message=self.write_through_failure,
                                       version=target)
                resp.accepted = False
                raise UpdateRefused(resp)
            return await self._update(target, mode)

    async def _update(self, target: int | None, mode: PauseMode) -> UpdateResponse:
        t0 = time.perf_counter()
        steps: list[StepReport] = []
        try:
            latest = await asyncio.to_thread(self.chain.latest)
            if latest is not None:
                self.state.latest_seen = latest.version
            if target is None:
                if latest is None:
                    raise DeltaError("missing", f"{self.args.store} holds no version")
                target = latest.version
            held = self.state.version
            if held is not None and target == held:
                return self._response(target, steps, t0)
            if held is not None and target < held:
                raise DeltaError("out_of_order", f"replica serves v{held}; v{target} is older")
            self.state.status = "updating"
            for group in _runs_of_deltas(await self._plan(target)):
                if len(group) == 1:
                    steps.append(await self._apply(group[0], mode))
                else:
                    steps += await self._apply_run(group, mode)
            self.state.status, self.state.damage = "ready", ""
            probe = None
            if self.probe_mode == "dense" and self.serving and any(s.kind != "delta" and s.write_s
                                                                   for s in steps):
                try:
                    probe = await self._write_probe("dense")
                except ProbeBusy as e:  # the version landed and was verified; only the probe waits
                    log.warning("write-through probe after the dense load of v%s skipped: %s", target, e)
                if probe is not None and probe["outcome"] == "failed":
                    raise WriteThroughFailed(probe["message"])
            resp = self._response(target, steps, t0)
            resp.write_probe = probe
            return resp
        except DeltaError as e:
            refusal = Refusal(reason=e.reason, message=e.message, version=target)
        except WriteThroughFailed as e:
            refusal = Refusal(reason="write_through", message=str(e), version=target)
        except Exception as e:  # noqa: BLE001 - reported, and the replica keeps serving
            log.exception("update to v%s failed", target)
            refusal = Refusal(reason="internal", message=f"{type(e).__name__}: {e}", version=target)
        if self.state.status == "updating":
            self.state.status = "ready"
        # Re-read the store next time: a refused object may be repaired or re-uploaded.
        self.chain.forget()
        metrics.REFUSED.labels(reason=refusal.reason).inc()
        log.warning("refused update to v%s: %s: %s (serving v%s)", refusal.version, refusal.reason,
                    refusal.message, self.state.version)
        resp = self._response(target, steps, t0)
        resp.refused, resp.accepted = refusal, False
        raise UpdateRefused(resp)

    def _response(self, target: int | None, steps: list[StepReport], t0: float) -> UpdateResponse:
        return UpdateResponse(version=self.state.version, commitment=self.state.commitment,
                              state_digest=self.state.state_digest,
                              state_fingerprint=self.state.state_fingerprint, target=target, steps=steps,
                              total_s=time.perf_counter() - t0)

    async def _plan(self, target: int) -> list:
        """Objects to apply. The base model this engine started from is free: when it is the
        chain's external genesis anchor, start there instead of downloading an anchor."""
        chain, held = self.chain, self.state.version
        if held is None:
            try:
                genesis = await asyncio.to_thread(chain.manifest, 0)
            except DeltaError:
                genesis = None
            ext = genesis.object("anchor") if genesis else None
            if genesis and ext is not None and ext.key is None and \
                    genesis.state_digest == self.base_state_digest and self.state.state_digest == \
                    self.base_state_digest:
                return [ext] + await asyncio.to_thread(chain.plan, 0, target, genesis.commitment)
        return await asyncio.to_thread(chain.plan, held, target, self.state.commitment or None)

    async def _apply_run(self, refs: list, mode: PauseMode) -> list[StepReport]:
        """Consecutive deltas as one: one stage, one pause, and a weight changed back and forth
        is written once. One at a time when they do not compose without the base (see
        ``shared.squash``); either way each is downloaded and checked once."""
        from shared.squash import NotSquashable, squash

        local: list[tuple[Path, StepReport]] = []
        try:
            for ref in refs:
                path, dt = await self._download(ref)
                local.append((path, StepReport(version=ref.version, kind="delta", base_version=ref.base_version,
                                               bytes=ref.size, download_s=dt)))
            try:
                data = await asyncio.to_thread(lambda: squash([DeltaFile.open(p) for p, _ in local]))
            except NotSquashable as e:
                log.info("v%d..v%d one by one: %s", refs[0].version, refs[-1].version, e)
                return [await self._apply(None, mode, local=item) for item in local]
            path = self._work / f"v{refs[0].base_version}-v{refs[-1].version}-{os.getpid()}.safetensors"
            await asyncio.to_thread(path.write_bytes, data)
            step = StepReport(version=refs[-1].version, kind="delta", base_version=refs[0].base_version,
                              bytes=sum(r.size for r in refs), download_s=sum(s.download_s for _, s in local))
            return [await self._apply(None, mode, local=(path, step))]
        finally:
            for p, _ in local:
                p.unlink(missing_ok=True)

    async def _apply(self, ref, mode: PauseMode, local: tuple[Path, StepReport] | None = None) -> StepReport:
        """Apply one object; ``local`` is a delta file already downloaded and checked (or
        squashed from several) with its step report."""
        if ref is not None and ref.kind == "anchor":
            return await self._apply_anchor(ref, mode)
        if local is None:
            step = StepReport(version=ref.version, kind="delta", base_version=ref.base_version, bytes=ref.size)
            path, step.download_s = await self._download(ref)
        else:
            path, step = local
        stage_id = None
        bases = path.with_name(path.name + ".bases")
        try:
            arg = {"path": str(path), "predict": self.args.predict}
            if await self._gather_bases(path, bases):
                arg["bases"] = str(bases)
            ranks = await self.job_all("stage", json.dumps(arg))
            stage_id = ranks[0]["stage"]
            _check_shards(ranks, f"v{step.version}")  # before any rank writes
            step.stage_s, step.changed = max(r["stage_s"] for r in ranks), ranks[0]["changed"]
            m = await asyncio.to_thread(self.chain.manifest, step.version)
            written = await self._paused_write(m, mode, "deltasync_write", stage_id, step)
            step.write_s = written["write_s"]
            a = time.perf_counter()
            audit = _merge_audits(await self.job_all("audit", stage_id))
            step.audit_s = time.perf_counter() - a
            if audit["bad"]:
                await self._paused_revert(stage_id, mode)
                raise DeltaError("digest_mismatch", f"v{step.version}: {len(audit['bad'])} tensors read "
                                 f"back wrong after the write (e.g. {audit['bad'][0]}); reverted")
            metrics.observe_rolling_audit(audit["rolled"], len(audit["drifted"]))
            if audit["drifted"]:  # wrong before this version landed: no revert brings a known version back
                why = (f"rolling audit after v{step.version}: {len(audit['drifted'])} tensor(s) differ from "
                       f"the version held (e.g. {audit['drifted'][0]})")
                await self._damaged(why)
                raise DeltaError("digest_mismatch", why)
        finally:
            path.unlink(missing_ok=True)
            bases.unlink(missing_ok=True)
            if stage_id is not None:  # success or not: the worker frees its old and new bits
                try:
                    await self.rpc("deltasync_release", stage_id)
                except Exception:  # noqa: BLE001 - the update's own outcome is what matters
                    log.exception("releasing stage %s failed", stage_id)
        metrics.observe_step(step)
        self._log_step(step)
        return step

    def _log_step(self, s: StepReport) -> None:
        log.info("applied v%d (%s, %d changed, %d B): download %.1f ms, stage %.1f ms, drain %.1f ms, "
                 "pause %.2f ms (write %.2f ms), audit %.1f ms", s.version, s.kind, s.changed, s.bytes,
                 s.download_s * 1e3, s.stage_s * 1e3, s.drain_s * 1e3, s.pause_s * 1e3, s.write_s * 1e3,
                 s.audit_s * 1e3)

    async def _damaged(self, why: str, until: str = "a re-sync") -> None:
        """The live weights are of no known version, or the engine's label or cache may not match
        them: say so (generation is refused, responses name no version) before generation resumes.
        A later update re-syncs from an anchor."""
        log.error("replica damaged: %s; refusing generation until %s", why, until)
        self.state.status = "damaged"
        self.state.damage = why
        self.state.version, self.state.commitment = None, ""
        self.state.state_digest, self.state.state_fingerprint = "", ""
        try:
            await self.engine.update_weight_version(DAMAGED_LABEL)
        except Exception:  # noqa: BLE001 - the status alone already refuses generation
            log.exception("labelling the damaged weights failed")

    async def _paused_write(self, m: Manifest, mode: PauseMode, method: str, arg: str, step: StepReport, *,
                            dense: bool = False) -> dict:
        """Pause, write, label, reset the prefix cache, resume. Returns the worker's answer.

        Whatever fails, generation resumes on one version or openly damaged: the state follows
        the worker as soon as it wrote; a failed dense write (``dense``, which leaves weights of
        no version) or a failed label or cache reset after a write marks the replica damaged
        before generation resumes."""
        engine, version = self.engine, m.version
        async with self.write_lock:
            a = time.perf_counter()
            if not self.user_paused:
                await self._pause_scheduler(mode)
            b = time.perf_counter()
            self.weight_writes += 1
            try:
                try:
                    ranks = await self.rpc_all(method, arg)
                    _check_shards(ranks, f"v{version}")  # a dense load's parts, read back
                    result = ranks[0]
                except BaseException as e:
                    if dense:
                        await self._damaged(f"dense load of v{version} failed: {e}")
                    raise
                # the worker holds `version` now, whatever fails below
                self.state.version, self.state.commitment = version, m.commitment
                self.state.state_digest, self.state.state_fingerprint = m.state_digest, m.state_fingerprint
                try:
                    await engine.update_weight_version(label_of(version))
                    await self._reset_prefix_cache(mode)
                except BaseException as e:
                    await self._damaged(f"v{version} written, but its label or cache reset failed: {e}")
                    raise
            finally:
                self.weight_writes += 1
                if not self.user_paused:
                    await engine.resume_generation()
            c = time.perf_counter()
        step.drain_s, step.pause_s = b - a, c - b
        metrics.VERSION.set(version)
        return result

    async def _pause_scheduler(self, mode: PauseMode) -> None:
        """``AsyncLLM.pause_generation`` minus its cosmetic 20 ms sleep after the pause (which
        would stop generation 6x longer than the write itself on the tiny model)."""
        core = getattr(self.engine, "engine_core", None)
        if core is not None and hasattr(core, "pause_scheduler_async"):
            await core.pause_scheduler_async(mode=mode, clear_cache=False)
        else:
            await self.engine.pause_generation(mode=mode, clear_cache=False)

    async def _reset_prefix_cache(self, mode: PauseMode) -> None:
        """Cached KV was computed with the old weights. Requests frozen by ``mode="keep"`` hold
        blocks, so they are preempted: they resume by recomputing their KV on the new weights."""
        if not await self.engine.reset_prefix_cache(reset_running_requests=mode == "keep"):
            await self.engine.reset_prefix_cache(reset_running_requests=True)

    async def _paused_revert(self, stage_id: str, mode: PauseMode) -> None:
        engine = self.engine
        async with self.write_lock:
            if not self.user_paused:
                await self._pause_scheduler(mode)
            self.weight_writes += 1
            try:
                try:
                    await self.rpc("deltasync_revert", stage_id)
                    held = await self.rpc("deltasync_held")
                    self.state.version, self.state.commitment = held["version"], held["commitment"]
                    self.state.state_digest, self.state.state_fingerprint = held["state_digest"], \
                        held["state_fingerprint"]
                    await engine.update_weight_version(label_of(self.state.version))
                    await self._reset_prefix_cache(mode)
                except BaseException as e:
                    await self._damaged(f"reverting stage {stage_id} failed: {e}")
                    raise
            finally:
                self.weight_writes += 1
                if not self.user_paused:
                    await engine.resume_generation()
        if self.state.version is not None:
            metrics.VERSION.set(self.state.version)

    async def _gather_bases(self, path: Path, out: Path) -> bool:
        """Positions coded against the base (``compact``) decode only against the whole base
        tensor, which no rank holds where the tensor is split across ranks: those tensors are put
        together here from every rank (as a live digest does) into the safetensors file ``out``,
        for each rank's staging. False: none needed. Nothing writes between this and the
        staging (one update at a time), and what staging predicts is checked by fingerprint."""
        if self.world == 1:
            return False
        header = await asyncio.to_thread(read_header, path)
        bases = {}
        for name, e in header.tensors.items():
            if e.positions == "classed" and name in self.split:
                whole = _tensor_of(await self.rpc_all("deltasync_tensor", name), e.dtype, math.prod(e.shape))
                if whole is None:
                    raise RuntimeError(f"{name}: the ranks' runs do not put the tensor together")
                bases[name] = whole.view(e.shape)
        if bases:
            await asyncio.to_thread(safetensors.torch.save_file, bases, str(out))
            log.info("v%d: %d tensor(s) split across ranks, coded against the base, put together for staging "
                     "(%.1f MB)", header.version, len(bases), sum(t.nbytes for t in bases.values()) / 1e6)
        return bool(bases)

    async def _apply_anchor(self, ref, mode: PauseMode) -> StepReport:
        m = await asyncio.to_thread(self.chain.manifest, ref.version)
        if ref.key is None:
            step = StepReport(version=ref.version, kind="external")
            if self.state.state_digest == m.state_digest and self.state.version is None:
                await self.rpc("deltasync_adopt", json.dumps({"version": ref.version, "commitment": m.commitment,
                                                              "state_digest": m.state_digest}))
                self.state.version, self.state.commitment = ref.version, m.commitment
                self.state.state_fingerprint = m.state_fingerprint
                try:  # the same weights: only the label of new tokens is at stake
                    await self.engine.update_weight_version(label_of(ref.version))
                except BaseException as e:
                    await self._damaged(f"labelling v{ref.version} failed: {e}")
                    raise
                metrics.VERSION.set(ref.version)
                return step
            path = await asyncio.to_thread(resolve_model_dir, ref.external)
            arg = {"path": str(path), "anchor": False}
        else:
            step = StepReport(version=ref.version, kind="anchor", bytes=ref.size)
            path, step.download_s = await self._download(ref)
            arg = {"path": str(path), "anchor": True}
        arg |= {"version": ref.version, "commitment": m.commitment, "state_digest": m.state_digest}
        try:
            if arg["anchor"]:  # every tensor's digest is checked before the pause
                a = time.perf_counter()
                await self.job("validate", str(path))
                step.stage_s = time.perf_counter() - a
            # a failed load leaves weights of no version: damaged (before generation resumes)
            r = await self._paused_write(m, mode, "deltasync_load", json.dumps(arg), step, dense=True)
            step.write_s = r["load_s"] + r["verify_s"]
        finally:
            if ref.key is not None:
                Path(path).unlink(missing_ok=True)
        metrics.observe_step(step)
        self._log_step(step)
        return step

    async def _download(self, ref) -> tuple[Path, float]:
        """Download to a file, checked against the manifest (``Chain.download``), while serving."""
        t0 = time.perf_counter()
        path = self._work / f"{Path(ref.key).stem}-{os.getpid()}.safetensors"
        size = (await asyncio.to_thread(self.chain.download, ref, path)).stat().st_size
        dt = time.perf_counter() - t0
        metrics.DOWNLOAD_BYTES.inc(size)
        metrics.DOWNLOAD_SECONDS.observe(dt)
        return path, dt

    # ------------------------------------------------------------------ write-through probe
    @property
    def probe_mode(self) -> str:
        return getattr(self.args, "write_probe", "off")

    async def write_probe(self, why: str) -> dict:
        """Run the write-through probe (see the module docstring) and return its report. After
        start-up it holds generation: new requests wait, those in flight finish first.

        What a pass proves: at the time it ran, for every parameter listed, an ``index_copy_``
        into that parameter's storage (the path a delta's write takes) changed the logprobs the
        engine computes for the probe prompt, and writing the old bits back gave the first run's
        logprobs bit for bit. Parameters not sampled were not checked. A backend that later
        replaces a parameter is caught by every audit (``LiveWeights.unbound``); one that copies
        a parameter later without replacing it is caught by the next probe only."""
        async with self._lock:
            return await self._write_probe(why)

    async def _write_probe(self, why: str) -> dict:
        if self.user_paused:
            raise ProbeBusy("generation is paused (POST /pause); resume it first")
        t0 = time.perf_counter()
        async with self.write_lock:
            held = self.serving
            if held:
                await self._hold_generation()
            t_held = time.perf_counter()
            self.weight_writes += 1  # no digest computed meanwhile may be kept
            try:
                report = await self._probe_params(why)
                report["held_s"] = t_held - t0
                if report["outcome"] == "failed":  # before any held request may pass the gate
                    self.write_through_failure = report["message"]
                    await self._damaged(report["message"], until="a restart with weights generation reads")
            except BaseException as e:
                await self._damaged(f"write-through probe ({why}) failed to run: {type(e).__name__}: {e}")
                raise
            finally:
                self.weight_writes += 1
                try:  # KV the perturbed runs cached must never be read
                    await self.engine.reset_prefix_cache(reset_running_requests=True)
                finally:
                    if held:
                        self._gate.set()
        report["seconds"] = time.perf_counter() - t0
        self.write_probe_report = report
        metrics.WRITE_PROBES.labels(outcome=report["outcome"]).inc()
        metrics.WRITE_PROBE_SECONDS.observe(report["seconds"])
        metrics.WRITE_PROBE_FAILED.set(len(report["failed"]))
        if report["outcome"] == "inconclusive":
            log.warning("write-through probe (%s): %s", why, report["message"])
        else:
            log.info("write-through probe (%s): %s in %.2fs (%d forwards, the first %.2fs; held %.2fs)", why,
                     report["message"], report["seconds"], report["forwards"], report["first_forward_s"],
                     report["held_s"])
        return report

    async def wait_open(self) -> None:
        """Return when no write-through probe holds generation."""
        while not self._gate.is_set():  # re-check: the gate may close again before we run
            await self._gate.wait()

    async def _hold_generation(self) -> None:
        """Close the gate to new requests and wait for those in the engine to finish."""
        self._gate.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), PROBE_HOLD_S)
        except TimeoutError:
            self._gate.set()
            raise ProbeBusy(f"requests still running after {PROBE_HOLD_S:.0f}s") from None

    async def _probe_params(self, why: str) -> dict:
        targets = await self.rpc("deltasync_probe_targets")
        params = targets["params"]
        k = getattr(self.args, "write_probe_params", 0) or len(params)
        chosen = params if k >= len(params) else sorted(random.sample(params, k), key=params.index)
        report = {"why": why, "version": self.state.version, "outcome": "passed", "ok": True,
                  "covered": len(params), "checked": len(chosen), "failed": [], "unbound": targets["unbound"],
                  "deterministic": True, "restored": True, "forwards": 0, "prompt_tokens": PROBE_TOKENS,
                  "params": []}
        a = time.perf_counter()
        first = await self._probe_logprobs(report)
        report["first_forward_s"] = time.perf_counter() - a  # at start-up, the engine's warm-up
        if await self._probe_logprobs(report) != first:
            report |= {"outcome": "inconclusive", "ok": False, "deterministic": False,
                       "message": "the probe prompt gave other logprobs on the same weights: "
                                  "nothing can be concluded from a change"}
            return report
        for t in chosen:
            await self.rpc("deltasync_perturb", t["param"])
            try:
                moved = await self._probe_logprobs(report) != first
            finally:
                await self.rpc("deltasync_restore", t["param"])
            report["params"].append(t | {"reaches": moved})
            if not moved:
                report["failed"].append(t["param"])
        report["restored"] = await self._probe_logprobs(report) == first
        bad = []
        if report["failed"]:
            bad.append(f"writes into {', '.join(report['failed'])} do not change the output (the engine "
                       "computes from something else, e.g. a packed copy)")
        if report["unbound"]:
            bad.append(f"{', '.join(report['unbound'])} are no longer the parameters this replica writes into")
        if not report["restored"]:
            bad.append("writing the old bits back did not restore the output bit for bit")
        if bad:
            report |= {"outcome": "failed", "ok": False, "message": "write-through probe: " + "; ".join(bad)}
        else:
            report["message"] = (f"writes into all {len(chosen)} of {len(params)} parameters checked reach "
                                 "the output, and restoring them restores it bit for bit")
        return report

    def _probe_prompt(self) -> list[int]:
        vocab = self.engine.vllm_config.model_config.get_vocab_size()
        rng = random.Random(PROBE_SEED)
        return [rng.randrange(vocab) for _ in range(PROBE_TOKENS)]

    async def _probe_logprobs(self, report: dict) -> tuple[str, ...]:
        """The probe prompt's logprobs (every prompt token after the first, then one greedy
        token's) as exact hex strings; the prefix cache is not read, and the gate not passed."""
        from vllm import SamplingParams

        ids = self._probe_prompt()
        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, logprobs=0,
                            skip_reading_prefix_cache=True)
        final = None
        async for out in self._raw_generate({"prompt_token_ids": ids}, sp,
                                            request_id=f"deltasync-probe-{uuid.uuid4().hex}"):
            final = out
        assert final is not None and final.prompt_logprobs is not None
        report["forwards"] += 1
        c = final.outputs[0]
        values = [pos[tok].logprob for pos, tok in zip(final.prompt_logprobs[1:], ids[1:])]
        values.append(c.logprobs[0][c.token_ids[0]].logprob)
        return tuple(float(v).hex() for v in values)

    # ------------------------------------------------------------------ vLLM-style pause
    async def pause(self, mode: PauseMode = "abort", clear_cache: bool = True) -> None:
        async with self.write_lock:
            self.user_paused = True
            await self.engine.pause_generation(mode=mode, clear_cache=clear_cache)

    async def resume(self) -> None:
        async with self.write_lock:
            self.user_paused = False
            await self.engine.resume_generation()

    # ------------------------------------------------------------------ reading
    def weights_key(self) -> tuple:
        """What the live weights are: the version served, its commitment, and the count of writes
        (a write reverted within one version still changes it)."""
        return self.state.version, self.state.commitment, self.weight_writes

    async def live_digest(self, fresh: bool = False) -> tuple[dict, bool]:
        """The worker's digest of the live weights (``job("digest")``) and whether it was cached.

        Not under the update lock: an update waits for a digest at most one tensor's hash (the
        worker reads tensor by tensor and starts again when a write comes between two).
        Single flight: at most one computation runs; a caller whose weights key is the running
        computation's shares it, any other waits for it to end and then starts (or shares) the
        next. A result is kept when no
        write came while it ran and it reports the version and commitment it was started for;
        a later call with the same key gets it back (``cached``) unless ``fresh``. So anonymous
        callers cause at most one computation per state of the weights."""
        while True:
            key = self.weights_key()
            if not fresh and self._digest is not None and self._digest[0] == key:
                return self._digest[1], True
            if self._digest_task is None:
                self._digest_task = (key, asyncio.create_task(self._compute_digest(key)))
            running_key, task = self._digest_task
            if running_key == key:
                return await asyncio.shield(task), False
            await asyncio.wait([task])  # started for weights since written: the next one is ours

    async def _gathered_digest(self) -> dict:
        """``job("digest")`` under tensor parallelism: a tensor held in parts is put together
        from every rank's runs, one tensor at a time, and hashed here (a tensor held whole is
        hashed on each rank that holds it, so every copy is checked). A pass that a write
        interrupted starts again; the last holds the write lock throughout."""
        t0 = time.perf_counter()
        for n in range(1, DIGEST_PASSES + 1):
            if n < DIGEST_PASSES:
                result = await self._gather_pass()
            else:
                async with self.write_lock:
                    result = await self._gather_pass()
            if result is not None:
                return result | {"passes": n, "digest_s": time.perf_counter() - t0}
        raise RuntimeError("unreachable: the last digest pass holds the write lock")

    async def _gather_pass(self) -> dict | None:
        key = self.weights_key()
        hashes, held, declared = {}, {}, {}
        for name, (dtype, shape) in self.specs.items():
            ranks = await self.rpc_all("deltasync_tensor", name)
            if self.weights_key() != key:
                return None
            held[name], declared[name] = ranks[0]["held"], ranks[0]["declared"]
            if (h := _tensor_hashes_of(ranks, dtype, math.prod(shape))) is not None:
                hashes[name] = h
        return {"version": key[0], "commitment": key[1], **compare_live(self.specs, held, declared, hashes)}

    async def _compute_digest(self, key: tuple) -> dict:
        try:
            d = await (self._gathered_digest() if self.world > 1 else self.job("digest"))
            metrics.DIGESTS.inc()
            metrics.DIGEST_SECONDS.observe(d["digest_s"])
            if d.get("passes", 1) > 1:
                log.info("live digest of v%s took %d passes (writes came between tensors)", d["version"],
                         d["passes"])
            if self.weights_key() == key and (d["version"], d["commitment"]) == key[:2]:
                self._digest = (key, d)
            return d
        finally:
            self._digest_task = None
