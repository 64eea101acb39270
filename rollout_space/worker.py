"""vLLM worker extension: exact deltas applied to the live parameters, in place.

Passed to vLLM as ``worker_extension_cls="rollout_space.worker.DeltaWorkerExtension"``; vLLM mixes
it into its worker class, and the server reaches it with ``collective_rpc("deltasync_...")``.
The engine core runs in its own process, so every argument and result crosses as a JSON string
(never pickle). Long work (staging, audits) runs on one background thread of the worker process,
so the engine keeps stepping while it runs; the server polls for the result. Live digests run on
a second one, tensor by tensor, so that neither a stage nor a paused write waits for a whole
digest (see ``_job_digest``). Only ``deltasync_write`` / ``deltasync_revert`` / ``deltasync_load``
write weights for a version, and the server calls them while generation is paused;
``deltasync_perturb`` / ``deltasync_restore`` write the write-through probe's perturbation (and
the old bits back) while the server holds generation (see ``RolloutEngine.write_probe``).

The audit (``_job_audit``) proves that the written parameters hold the target bits, not that
generation computes from them: see :mod:`rollout_space.live_weights` for exactly what each check proves.

Importing this module installs :func:`rollout_space.cpu_weights.keep_plain_cpu_weights`, which
must happen before the model is loaded; vLLM imports worker extensions at worker start.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import os
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from shared.apply import Patch
from shared.checkpoint import checkpoint_files, tied_aliases
from shared.codec import DeltaFile
from shared.digest import tensor_digest
from shared.fingerprint import tensor_fingerprint
from shared.errors import DeltaError
from shared.warmup import warm_in_background

from .cpu_weights import keep_plain_cpu_weights
from .mapping import EngineMap, LiveMap, build_map, checkpoint_specs, map_key, param_specs
from .live_weights import DIGEST_PASSES, LiveWeights, Staged, compare_live

keep_plain_cpu_weights()
log = logging.getLogger("rollout_space.worker")


def _ok(**result: Any) -> str:
    return json.dumps({"ok": True, **result})


def _err(e: BaseException) -> str:
    if isinstance(e, DeltaError):
        return json.dumps({"ok": False, "reason": e.reason, "message": e.message})
    log.error("deltasync worker error: %s", traceback.format_exc())
    return json.dumps({"ok": False, "reason": "internal", "message": f"{type(e).__name__}: {e}"})


class _State:
    """Per-worker state, created by ``deltasync_init``."""

    def __init__(self, weights: LiveWeights, emap: EngineMap):
        self.weights, self.map = weights, emap
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltasync-stage")
        self.reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltasync-digest")
        self.jobs: dict[str, Future] = {}
        self.staged: dict[str, Staged] = {}
        self.ids = itertools.count(1)
        self.lock = threading.Lock()  # weights are written only under it
        self.writes = 0  # bumped under ``lock`` by every write (and by adopt): a digest pass restarts
        self.perturbed: dict[str, Patch] = {}  # write-through probe: parameter -> its perturbation


class DeltaWorkerExtension:
    """Methods vLLM adds to its worker (names are prefixed to avoid clashing with the worker's)."""

    # ------------------------------------------------------------------ helpers
    def _ds(self) -> _State:
        st = getattr(self, "_deltasync_state", None)
        if st is None:
            raise RuntimeError("deltasync_init has not run on this worker")
        return st

    def _ds_model(self) -> torch.nn.Module:
        return self.model_runner.model  # type: ignore[attr-defined]

    def _ds_rank(self) -> tuple[int, int]:
        pc = self.vllm_config.parallel_config  # type: ignore[attr-defined]
        return getattr(self, "rank", 0), pc.world_size

    # ------------------------------------------------------------------ set-up
    def deltasync_init(self, arg: str) -> str:
        """Build (or load from cache) the checkpoint->engine map; reload real weights if probing
        destroyed them; return the live state digest. ``arg``: {model_dir, map_cache, audit_every}."""
        try:
            cfg = json.loads(arg)
            model = self._ds_model()
            files = checkpoint_files(cfg["model_dir"])
            specs = checkpoint_specs(files)
            for name in tied_aliases(cfg["model_dir"]):  # a tied lm_head.weight saved anyway: the
                specs.pop(name, None)  # state is the model's, as the trainer's module_state gives it
            rank, world = self._ds_rank()
            import vllm

            hf_config = self.vllm_config.model_config.hf_config.to_dict()  # type: ignore[attr-defined]
            for k in ("_name_or_path", "transformers_version", "torch_dtype", "dtype"):
                hf_config.pop(k, None)
            key = map_key(specs, param_specs(model), config=hf_config, rank=rank, world=world,
                          engine=f"vllm-{vllm.__version__}")
            cache = Path(cfg["map_cache"]) / f"{key}.json"
            t0 = time.perf_counter()
            built = False
            if cache.exists():
                emap = EngineMap.load(cache)
            else:
                emap = build_map(model, specs, key=key, rank=rank, world=world)
                emap.save(cache)
                built = True
                with torch.no_grad():  # probing overwrote the weights: load the real ones
                    from safetensors import safe_open

                    for f in files:
                        with safe_open(str(f), framework="pt") as fh:
                            model.load_weights((n, fh.get_tensor(n)) for n in fh.keys()
                                               if n in emap.tensors)
            t_map = time.perf_counter() - t0
            live = LiveMap(emap, model)
            split = [n for n in emap.tensors if not live.whole(n)]  # this rank's shards of them
            from safetensors import safe_open

            t1 = time.perf_counter()
            file_digests: dict[str, str] = {}
            file_fps: dict[str, str] = {}  # of the tensors the engine does not read back whole
            for f in files:
                with safe_open(str(f), framework="pt") as fh:
                    for n in fh.keys():
                        if n in specs:
                            t = fh.get_tensor(n)
                            file_digests[n] = tensor_digest(t)
                            if n in emap.ignored or n in split:
                                file_fps[n] = tensor_fingerprint(t).hex()
            weights = LiveWeights(model, live, specs, {n: file_digests[n] for n in file_fps}, file_fps,
                                  audit_every=cfg.get("audit_every", 8))
            weights.read_back()
            for n in emap.tensors:  # the live state must be the checkpoint's, bit for bit
                if n not in split and file_digests[n] != weights.held.digests[n]:
                    raise DeltaError("digest_mismatch", f"{n}: live weights differ from the checkpoint "
                                     "after loading")
            shards = {n: (weights.held.fingerprints[n], file_fps[n]) for n in split}  # the server adds them up
            self._deltasync_state = _State(weights, emap)
            warm_in_background()  # the numba kernels of staging, compiled before the first delta
            return _ok(state_digest=weights.held.state_digest, state_fingerprint=weights.held.state_fingerprint,
                       tensors=len(emap.tensors), shards=shards,
                       specs=weights.held.specs,
                       ignored=emap.ignored, runs=emap.runs, map_built=built, map_s=t_map,
                       map_build_s=emap.build_s, digest_s=time.perf_counter() - t1, key=key,
                       pid=os.getpid())
        except BaseException as e:  # noqa: BLE001 - reported to the server
            return _err(e)

    # ------------------------------------------------------------------ background jobs
    def deltasync_submit(self, kind: str, arg: str = "") -> str:
        """Start ``stage`` ({path, predict}), ``audit`` (stage id), ``validate`` (anchor path) or
        ``digest`` in the background; returns the job id to poll."""
        st = self._ds()
        job = f"{kind}-{next(st.ids)}"
        fn = {"stage": self._job_stage, "audit": self._job_audit, "digest": self._job_digest,
              "validate": self._job_validate}[kind]
        st.jobs[job] = (st.reader if kind == "digest" else st.pool).submit(fn, job, arg)
        return job

    def deltasync_poll(self, job: str, keep: str = "") -> str:
        """``{"done": false}`` while running, else the job's result, then forgotten unless ``keep``
        (several ranks: the server polls until every rank is done, then takes the results)."""
        st = self._ds()
        fut = st.jobs.get(job)
        if fut is None:
            return json.dumps({"done": True, "ok": False, "reason": "internal",
                               "message": f"unknown job {job}"})
        if not fut.done():
            return json.dumps({"done": False})
        if not keep:
            del st.jobs[job]
        return json.dumps({"done": True, **json.loads(fut.result())})

    def _job_stage(self, job: str, arg: str) -> str:
        try:
            a = json.loads(arg)
            st = self._ds()
            delta = DeltaFile.open(a["path"])
            bases = safetensors.torch.load_file(a["bases"]) if "bases" in a else {}  # see the engine's _gather_bases
            with st.lock:  # the weights must not change while we gather old bits
                staged = st.weights.stage(delta, predict=a.get("predict", True), bases=bases)
            st.staged[job] = staged
            h = staged.header
            return _ok(stage=job, version=h.version, base_version=h.base_version, shards=staged.shards,
                       changed=staged.changed, patches=len(staged.patches),
                       tensors=len(staged.touched), **staged.timings)
        except BaseException as e:  # noqa: BLE001
            return _err(e)

    def _job_validate(self, job: str, path: str) -> str:
        """Decode every tensor of an anchor (each checked against its digest), writing nothing."""
        try:
            t0 = time.perf_counter()
            delta = DeltaFile.open(path)
            n = sum(1 for _ in delta.changes())
            return _ok(tensors=n, validate_s=time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001
            return _err(e)

    def _job_audit(self, job: str, stage: str) -> str:
        """Read the written positions back (``LiveWeights.audit``): the parameters hold the
        delta's bits. Then, unless that failed, the rolling audit's next slice of whole tensors
        (``drifted``: live fingerprints that are not the held ones). Neither can see a backend
        that computes from a copy of the weights; the write probe can."""
        try:
            st = self._ds()
            staged = st.staged[stage]
            t0 = time.perf_counter()
            with st.lock:
                bad = st.weights.audit(staged)
                t1 = time.perf_counter()
                rolled, drifted = ([], []) if bad else st.weights.rolling_audit()
            return _ok(bad=bad, audit_s=t1 - t0, rolled=len(rolled), drifted=drifted,
                       rolling_s=time.perf_counter() - t1, audit_every=st.weights.audit_every)
        except BaseException as e:  # noqa: BLE001
            return _err(e)

    def _job_digest(self, job: str, arg: str) -> str:
        """The state digest of the live weights and the version they are held to be.

        Tensor by tensor, taking the weights lock for one tensor at a time: a write that comes
        meanwhile (it is paused generation) waits for one tensor's hash, not the whole digest.
        A pass that a write interrupted starts again; the last of ``DIGEST_PASSES`` holds the
        lock throughout, so a digest always ends. Every pass reads one state of the weights."""
        try:
            st = self._ds()
            t0 = time.perf_counter()
            for n in range(1, DIGEST_PASSES + 1):
                result = self._ds_digest_pass(st, whole=n == DIGEST_PASSES)
                if result is not None:
                    return _ok(**result, passes=n, digest_s=time.perf_counter() - t0)
            raise RuntimeError("unreachable: the last digest pass holds the lock")
        except BaseException as e:  # noqa: BLE001
            return _err(e)

    def deltasync_tensor(self, name: str) -> str:
        """One tensor for a live digest under tensor parallelism, read under the weights lock:
        its blake3 digest (and fingerprint, see :meth:`LiveWeights.hash_against`) when this rank
        holds it whole, else this rank's runs (checkpoint start, length) and their bytes
        (base64), for the server to put together; with the held digest and declared fingerprint."""
        try:
            st = self._ds()
            w = st.weights
            with st.lock:
                out: dict[str, Any] = {"held": w.held.digests[name], "declared": w.held.declared[name]}
                if name in w.live.map.tensors:
                    if w.live.whole(name):
                        out["digest"], out["fingerprint"] = w.hash_against(name, out["held"])
                    else:
                        runs = list(w.live.runs(name))
                        data = torch.cat([r.reshape(-1) for _, r in runs]).view(torch.uint8)
                        out["runs"] = [(s, r.numel()) for s, r in runs]
                        out["data"] = base64.b64encode(data.cpu().numpy().tobytes()).decode()
            return _ok(**out)
        except BaseException as e:  # noqa: BLE001
            return _err(e)

    def _ds_digest_pass(self, st: _State, *, whole: bool) -> dict | None:
        """One pass; None when a write came between two tensors (``whole``: none can)."""
        outer, inner = (st.lock, nullcontext()) if whole else (nullcontext(), st.lock)
        with outer:
            with inner:
                writes, held = st.writes, st.weights.held.copy()
            hashes: dict[str, tuple[str, str | None]] = {}
            live = st.weights.live.map.tensors
            for name in (n for n in held.specs if n in live):
                with inner:
                    if st.writes != writes:
                        return None
                    hashes[name] = st.weights.hash_against(name, held.digests[name])
        return {"version": held.version, "commitment": held.commitment,
                **compare_live(held.specs, held.digests, held.declared, hashes)}

    # ------------------------------------------------------------------ writes (paused)
    def deltasync_write(self, stage: str) -> str:
        try:
            st = self._ds()
            staged = st.staged[stage]
            with st.lock:
                st.writes += 1
                dt = st.weights.write(staged)
            return _ok(write_s=dt, version=staged.header.version)
        except BaseException as e:  # noqa: BLE001
            return _err(e)

    def deltasync_revert(self, stage: str) -> str:
        try:
            st = self._ds()
            staged = st.staged[stage]
            with st.lock:
                st.writes += 1
                dt = st.weights.revert(staged)
            return _ok(revert_s=dt, version=st.weights.held.version)
        except BaseException as e:  # noqa: BLE001
            return _err(e)

    def deltasync_release(self, stage: str) -> str:
        """Forget a staged update (frees its old and new bits)."""
        self._ds().staged.pop(stage, None)
        return _ok()

    def deltasync_load(self, arg: str) -> str:
        """Dense load (anchor file or external checkpoint) + full check. ``arg``: {path, version,
        commitment, state_digest, anchor}."""
        try:
            a = json.loads(arg)
            st = self._ds()
            header = None
            if a.get("anchor"):
                delta = DeltaFile.open(a["path"])
                header = delta.header
                if header.kind != "anchor" or header.version != a["version"] or \
                        header.commitment != a["commitment"]:
                    raise DeltaError("format", f"{a['path']} is not the anchor of v{a['version']}")
                files = [Path(a["path"])]
            else:
                files = checkpoint_files(a["path"])
            with st.lock:
                st.writes += 1
                st.staged.clear()
                timings = st.weights.load_dense(files, version=a["version"], commitment=a["commitment"],
                                                state_digest=a["state_digest"], header=header)
            return _ok(version=a["version"], state_digest=st.weights.held.state_digest, **timings)
        except BaseException as e:  # noqa: BLE001
            return _err(e)

    def deltasync_adopt(self, arg: str) -> str:
        try:
            a = json.loads(arg)
            st = self._ds()
            with st.lock:
                st.writes += 1
                st.weights.adopt(version=a["version"], commitment=a["commitment"],
                                 state_digest=a["state_digest"])
            return _ok(version=a["version"])
        except BaseException as e:  # noqa: BLE001
            return _err(e)

    # ------------------------------------------------------------------ write-through probe
    def deltasync_probe_targets(self) -> str:
        """The engine parameters a delta can write into (``LiveWeights.probe_targets``), and any
        the model no longer holds as bound at start-up."""
        try:
            w = self._ds().weights
            return _ok(params=w.probe_targets(), unbound=w.unbound())
        except BaseException as e:  # noqa: BLE001
            return _err(e)

    def deltasync_perturb(self, param: str) -> str:
        """Write the probe's perturbation into one parameter, through a delta's write path."""
        try:
            st = self._ds()
            with st.lock:
                if st.perturbed:
                    raise RuntimeError(f"{next(iter(st.perturbed))} is still perturbed")
                patch = st.weights.perturbation(param)
                st.writes += 1
                with torch.no_grad():
                    patch.apply()
                st.perturbed[param] = patch
                self._ds_sync(patch)
            return _ok(param=param, elements=int(patch.positions.numel()))
        except BaseException as e:  # noqa: BLE001
            return _err(e)

    def deltasync_restore(self, param: str) -> str:
        """Write the old bits back (one more ``index_copy_``) and read them back."""
        try:
            st = self._ds()
            with st.lock:
                patch = st.perturbed.pop(param)
                st.writes += 1
                with torch.no_grad():
                    patch.revert()
                self._ds_sync(patch)
                if not torch.equal(patch.target.index_select(0, patch.positions), patch.old):
                    raise DeltaError("digest_mismatch", f"{param} reads back other bits after restoring")
            return _ok(param=param)
        except BaseException as e:  # noqa: BLE001
            return _err(e)

    @staticmethod
    def _ds_sync(patch: Patch) -> None:
        if patch.target.is_cuda:
            torch.cuda.synchronize()  # the probe's next forward must see the write

    def deltasync_held(self) -> str:
        h = self._ds().weights.held
        return _ok(version=h.version, commitment=h.commitment, state_digest=h.state_digest,
                   state_fingerprint=h.state_fingerprint)
