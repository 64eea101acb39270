"""Compile the numba kernels before the first version needs them.

numba compiles a kernel at its first call and caches the machine code on disk, keyed to the CPU
it was built for (``NUMBA_CACHE_DIR``, else ``__pycache__`` beside the source when it is
writable, else ``~/.cache``). A process with a cold cache paid it on its first version: on the
2-core VM of this project ~3 s inside the trainer's first ``publish()`` (the scans, holding the
training loop), ~12 s in the encoder thread after it, and ~3 s in a replica's first apply
(``python -m bench.cold_start``). A Space's container starts with an empty cache unless its image
holds one.

So the images run :func:`warm` at build time (``deltasync warmup``, into their
``NUMBA_CACHE_DIR``), which helps where the Space runs on the kind of CPU the image was built
on, and the Spaces call :func:`warm_in_background` at start-up, which compiles (or loads) in a
thread while the model loads. Both run the library's own paths on a small synthetic model, not
a list of signatures, so whatever the real paths call is what gets compiled.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time

import torch

log = logging.getLogger("deltasync.warmup")


def _model(dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"embed": (1024, 256), "proj": (256, 256), "norm": (256,), "busy": (128, 128)}
    return {n: (torch.randn(s, generator=g) * 0.02).to(dtype) for n, s in shapes.items()}


def _step(state: dict[str, torch.Tensor], version: int) -> None:
    """Changes of the kinds a trainer makes, in place, so that every way of coding them is used:
    moves of a few ulps in ~1% of each tensor (values coded as "add"), low bits flipped (as
    "xor"), a run of new values (positions coded by zstd), a busy tensor (copied by publish(),
    scanned in the encoder thread) and, every other version, a change over a scan's cap (1/8 of
    a tensor: found in one pass, its positions kept; then 3/4: every element coded)."""
    g = torch.Generator().manual_seed(version)

    def some(t: torch.Tensor, share: float) -> torch.Tensor:
        return torch.randperm(t.numel(), generator=g)[: max(1, int(t.numel() * share))]

    for name, t in state.items():
        if name == "proj":
            continue  # its bits are flipped below
        flat = t.view(-1)
        at = some(flat, 1 / 30 if name == "busy" else 1 / 100)
        flat[at] = flat[at] * (1 + 2 ** -6) + 1e-4
    proj = state["proj"].view(-1)
    at = some(proj, {1: 1 / 8, 3: 3 / 4}.get(version, 1 / 100))
    flips = torch.randint(1, 4, (at.numel(),), generator=g, dtype=torch.int16)
    proj[at] = (proj[at].bfloat16().view(torch.int16) ^ flips).view(torch.bfloat16).to(proj.dtype)
    state["embed"].view(-1)[5000:11000] = torch.randn(6000, generator=g).to(state["embed"].dtype) * 0.02


def _publish(dtype: torch.dtype) -> list[bytes]:
    """Versions of a synthetic model through a :class:`DeltaPublisher`, as a trainer publishes
    (bf16 weights, or fp32 master weights cast to bf16 in the scan): the delta files in order."""
    from .chain import AnchorPolicy
    from .publisher import DeltaPublisher
    from .stores import open_store

    state = _model(dtype, seed=0)
    with tempfile.TemporaryDirectory(prefix="deltasync-warmup-") as folder:
        with DeltaPublisher(state, folder, keep_anchors=10**6, digests="anchors",
                            policy=AnchorPolicy(catchup_fraction=1e9)) as pub:
            for version in range(1, 5):
                _step(state, version)
                pub.publish().wait(600)
        store = open_store(folder)
        return [store.get(key) for key in sorted(store.list("deltas/"))]


def _apply(deltas: list[bytes]) -> None:
    """What a replica does with each delta of a chain: decode, gather the old bits and the
    fingerprint changes (as a replica stages), apply in place (as the CLI does), read the written
    bits back (the audit), and fingerprint whole tensors and runs of them (the rolling audit)."""
    from .apply import Patch, apply_delta, flat_bits, landed
    from .codec import DeltaFile
    from .fingerprint import GatherItem, GatherTarget, gather_updates, one_run, runs_fingerprint, tensor_fingerprint

    state = _model(torch.bfloat16, seed=0)
    for data in deltas:
        delta = DeltaFile.from_bytes(data)
        changes = [c for c in delta.decode(state) if c is not None and c.positions is not None]
        staged = gather_updates([GatherItem(GatherTarget(flat_bits(state[c.name]), one_run(state[c.name].numel()),
                                                         state[c.name].numel()), c.positions, c.bits, c.mode)
                                  for c in changes])
        apply_delta(delta, state)
        if not all(landed([Patch(c.name, flat_bits(state[c.name]), g.dest, g.new, g.old)
                           for c, g in zip(changes, staged)])):
            raise RuntimeError("a warm-up write did not read back")
    for t in state.values():
        tensor_fingerprint(t, threads=False)
        runs_fingerprint(flat_bits(t), one_run(t.numel()).numpy())


def warm() -> dict[str, float]:
    """Run a trainer's paths and then a replica's once, on a small synthetic model; seconds of
    each ("publish", "apply"). A replica warms the publish part too: it makes the deltas."""
    t0 = time.perf_counter()
    chains = [_publish(dtype) for dtype in (torch.bfloat16, torch.float32)]
    t1 = time.perf_counter()
    for deltas in chains:
        _apply(deltas)
    return {"publish": t1 - t0, "apply": time.perf_counter() - t1}


_STARTED: threading.Thread | None = None
_STARTED_LOCK = threading.Lock()


def warm_in_background() -> threading.Thread:
    """:func:`warm` in a daemon thread, once per process (later calls return the same thread); a
    failure is logged, not raised (the real paths then compile on first use, as without it)."""
    global _STARTED

    def run() -> None:
        try:
            took = warm()
            log.info("numba kernels ready: %s", ", ".join(f"{k} {v:.1f} s" for k, v in took.items()))
        except Exception:  # noqa: BLE001 - it only costs time later
            log.exception("warming the numba kernels failed")

    with _STARTED_LOCK:
        if _STARTED is None:
            _STARTED = threading.Thread(target=run, name="deltasync-warmup", daemon=True)
            _STARTED.start()
        return _STARTED
