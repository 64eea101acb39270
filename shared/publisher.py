"""Trainer side: turn every optimizer step into the next version of a chain in a store.

``DeltaPublisher.publish()`` is called right after ``optimizer.step()``. It holds the training
loop only for change detection, which reads the live weights (they may change again as soon as
it returns) and refreshes one bf16 snapshot in place. Everything else reads that snapshot alone
and runs in an encoder thread: digests, entropy coding, the delta file, anchors. The next
``publish()`` waits for it before touching the snapshot again, so the encoder never sees a
snapshot in flux; a training step longer than the encoding hides it entirely. The report's
digests, commitment, kind and size are filled in by the encoder (reading them waits for it), as
are ``DeltaPublisher.commitment`` and ``state_digest``. Uploading and moving ``latest`` run in
one background thread behind a bounded queue, strictly in version order, so training only waits
when uploads fall behind. Each replica is notified by a
thread of its own, in version order, so a slow or unreachable replica delays neither the uploads
nor the other replicas; a report is done once its version landed and every replica answered.
"""

from __future__ import annotations

import atexit
import bisect
import copy
import logging
import queue
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import httpx
import torch

from .chain import AnchorPolicy, Chain, ObjectRef, anchor_key, delta_key, ref_for
from .changes import (
    INT_VIEW,
    THREADS_FROM_CHANGES,
    Changes,
    find_changes,
    find_changes_many,
    map_balanced,
    map_batches,
    scannable,
    unsigned_view,
)
from .checkpoint import module_state
from .codec import (
    DenseChange,
    EncodedTensor,
    Header,
    TensorEntry,
    anchor_header,
    build_delta,
    change_batches,
    detect_tensor,
    encode_changes,
    encode_changes_many,
    encode_found,
    encode_positions_classed,
    encode_tensor,
    fingerprints_after,
    full_pass_change,
    save_anchor,
    save_delta,
    tensor_entry,
)
from .digest import tensor_digest
from .errors import DeltaError
from .fingerprint import Fingerprint, fingerprint_delta
from .fingerprint import fingerprints as fingerprints_of
from .lock import WriterLock
from .stores import Store, open_store

log = logging.getLogger("deltasync.publisher")
_ENCODED_FIELDS = frozenset({"kind", "changed", "int32_bf16_bytes", "payload_bytes", "commitment", "state_fingerprint",
                             "state_digest", "encoder_s", "encoder_parts"})
# The default copy_from (DeltaPublisher): a tensor that changed in this share of its elements or
# more last version is "busy", and publish() copies it instead of scanning it. At 26M parameters,
# 5-8% changed, a scan that records many changes (or a dense change's XOR pass) held the training
# loop 1.5-2x as long as the copy; at ~1% the two cost about the same for bf16 weights.
BUSY_FRACTION = 1 / 64
DIGESTS = ("every", "anchors")


@dataclass
class PublishReport:
    version: int
    kind: str  # "anchor" | "delta" | "delta+anchor"
    changed: int
    numel: int
    payload_bytes: int  # delta bytes (what a replica one version behind downloads)
    dense_bytes: int
    int32_bf16_bytes: int  # the TRL prototype format's size for the same change
    encode_s: float  # how long publish() held the training loop
    # how long the encoder thread took, off the training loop: fingerprints, digests of the
    # touched tensors (digests="every"), entropy coding, the delta file (and an anchor when due)
    encoder_s: float = 0.0
    # encoder_s split, so that a slow encoder says where (wall seconds; the rest is bookkeeping):
    # resolve_s: changes of the tensors publish() copied, found from their old bits; code_s: new
    # fingerprints, blake3 digests of the touched tensors (digests="every") and entropy coding
    # (several threads for a large change); header_s: the entries, state fingerprint, commitment
    # and payload digest (and with digests="every", digests unknown since the last anchor);
    # file_s: the delta's bytes; anchor_s: the anchor, when one is due
    encoder_parts: dict[str, float] = field(default_factory=dict)
    upload_s: float = 0.0
    notify_s: float = 0.0
    commitment: str = ""
    state_fingerprint: str = ""
    state_digest: str = ""  # blake3; "" for a delta version when digests="anchors"
    # url -> the replica's /update answer (JSON), or {"error": ...} when refused or unreachable
    replicas: dict[str, dict] = field(default_factory=dict)
    error: str | None = None  # why the upload failed for good ("failed"), or why it was skipped
    dropped: list[int] = field(default_factory=list)  # versions retention deleted after this one landed
    _done: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)
    # set once the encoder filled in the fields in _ENCODED_FIELDS
    _encoded: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)
    _waiting: int = field(default=0, repr=False, compare=False)  # replicas yet to answer
    _notify_t0: float = field(default=0.0, repr=False, compare=False)

    def __getattribute__(self, name: str):
        """The fields the encoder fills in wait for it: ``publish()`` returns before they exist,
        and a caller that reads them right away (a test comparing digests) must get the truth."""
        if name in _ENCODED_FIELDS:
            object.__getattribute__(self, "_encoded").wait()
        return object.__getattribute__(self, name)

    @property
    def changed_fraction(self) -> float:
        return self.changed / max(self.numel, 1)

    @property
    def done(self) -> bool:
        """The background thread has finished with this version (uploaded and announced, or not)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> PublishReport:
        """Block until this version is uploaded and announced; raise :class:`PublishError` if it
        never landed. ``publish()`` returns before that, and fills in this report as it goes."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"v{self.version} is still being uploaded")
        if self.kind in ("failed", "skipped"):
            raise PublishError(f"v{self.version} was not published: {self.error}")
        return self

    def as_dict(self) -> dict:
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if not f.name.startswith("_")}
        return d | {"changed_fraction": self.changed_fraction}


class PublishError(RuntimeError):
    """A version did not land in the store (the chain heals with an anchor at a later version)."""


@dataclass
class _Copied:
    """A busy tensor's new bits copied into the snapshot at publish(); ``old``: its old bits (the
    spare buffer the copy swapped out), for the encoder to find the change from."""

    old: torch.Tensor


@dataclass
class _Found:
    """One version's detection, for the encoder: per tensor its encoding, or its changes still
    to encode from the snapshot."""

    version: int
    found: dict[str, EncodedTensor | Changes | DenseChange | _Copied]
    report: PublishReport
    copyable: set[str]  # the host tensors publish() may copy instead of scanning (see copy_from)


def _changed(found: EncodedTensor | Changes | DenseChange) -> int:
    return found.entry.changed if isinstance(found, EncodedTensor) else found.count


def _encode_work(found: EncodedTensor | Changes | DenseChange, numel: int) -> int:
    """What encoding one tensor of ``numel`` elements costs, in changes: what detection left to do."""
    if isinstance(found, Changes):
        return found.count
    return 0 if isinstance(found, EncodedTensor) else numel


@dataclass
class _Job:
    header: Header
    objects: dict[str, bytes | Path]
    refs: list[ObjectRef]
    report: PublishReport
    tmpdir: tempfile.TemporaryDirectory | None = None


class DeltaPublisher:
    """Publish a model's bf16 weights as an exact version chain.

    ``model`` is an ``nn.Module`` or a name->tensor mapping, in checkpoint coordinates (tied
    weights once). fp32 master weights are compared after the cast to ``dtype``, which is what
    replicas serve (``dtype=None`` publishes every tensor in its own dtype). ``external_base``
    names a checkpoint every replica already has (a Hub id or path): then version 0 is not
    uploaded, and replicas check its state digest instead.
    ``compact`` codes positions per exponent class where that is smaller (about a third less
    for positions at RL learning rates), at the price of a pass over each changed tensor at
    both ends.

    ``digests``: when to hash tensors whole with blake3. A version's identity (its commitment)
    binds its state fingerprint, which the publisher keeps up to date in O(changes), so blake3
    digests are an audit, not the chain: ``"every"`` version (each delta then names every
    touched tensor's digest, so a replica's ``/weights/digest`` is checked against blake3
    digests every version; the whole model is hashed per version, O(model) in the encoder
    thread) or only ``"anchors"`` (deltas carry none: the per-version cost beyond change
    detection is O(changes); replicas audit by fingerprint between anchors). It may change
    between versions (back to ``"every"``, the digests unknown meanwhile are computed once).

    Retention: after each anchor lands, versions older than the ``keep_anchors``-th newest
    anchor (default 2) are deleted from the store, and the report lists them in ``dropped``;
    pass a large ``keep_anchors`` to keep the whole history.

    Change detection runs where the weights live: for tensors on an accelerator the publisher
    keeps a second bf16 snapshot on that device, compares there with torch, and only positions
    and XORs cross to the host (whose snapshot still serves anchors and digests), never the whole
    model per version. ``detect``: ``"auto"`` (that, and numba for host tensors), ``"torch"``
    (the device path even for host tensors, which the tests use) or ``"numba"`` (copy every
    tensor to the host and compare there, as before). A CPU trainer should call
    :func:`shared.openmp.bound_openmp_spin` before it imports torch: otherwise torch's OpenMP
    workers spin on the cores through the first ~10 ms of every ``publish()``.

    ``copy_from``: on the host, ``publish()`` scans each tensor against the snapshot (refreshing
    it), except a tensor that changed in this share of its elements or more last version (or
    whose scan found it dense): that one is copied into a spare buffer, which becomes the
    snapshot, and the encoder thread finds its change from the old and new bits while the next
    step trains. A scan that records many changes holds the training loop longer than a copy;
    at ~1% changed the two cost about the same, for bf16 weights and for fp32 master weights
    (the cast fused into the scan, or into the copy). ``copy_from=0`` copies
    every tensor (``publish()`` then holds the loop for a copy of the model) at the price of a
    second snapshot in host memory (2 bytes a parameter for bf16); the spares of busy tensors
    are that price in part.

    The publisher is the store's only writer while it lives (``writer.lock``, see
    :mod:`shared.lock`); ``close()`` uploads what is queued and releases it, and runs at exit
    if the script never called it.
    """

    def __init__(self, model: torch.nn.Module | Mapping[str, torch.Tensor], store: Store | str, *,
                 replicas: Sequence[str] = (), token: str | None = None,
                 policy: AnchorPolicy | None = None, keep_anchors: int = 2,
                 dtype: torch.dtype | None = torch.bfloat16, external_base: str | None = None,
                 queue_size: int = 2, retries: int = 4, backoff_s: float = 0.5,
                 notify_timeout_s: float = 120.0, compact: bool = False,
                 on_report: Callable[[PublishReport], None] | None = None, detect: str = "auto",
                 digests: str = "every", copy_from: float = BUSY_FRACTION):
        if detect not in ("auto", "torch", "numba"):
            raise ValueError(f"detect={detect!r}: auto, torch or numba")
        if digests not in DIGESTS:
            raise ValueError(f"digests={digests!r}: {' or '.join(DIGESTS)}")
        if not 0.0 <= copy_from <= 1.0:
            raise ValueError(f"copy_from={copy_from}: a share of a tensor's elements, 0 to 1")
        self.digests, self.copy_from = digests, copy_from
        self.model, self.dtype = model, dtype
        self.store = open_store(store) if isinstance(store, str) else store
        self.chain = Chain(self.store)
        self.replicas, self.token = list(replicas), token
        self.policy, self.keep_anchors = policy or AnchorPolicy(), keep_anchors
        self.retries, self.backoff_s, self.notify_timeout_s = retries, backoff_s, notify_timeout_s
        self.on_report, self.compact, self.detect = on_report, compact, detect
        self.reports: list[PublishReport] = []
        self._snapshot = {n: self._cast(t).clone() for n, t in self._live().items()}
        self._device_snapshot: dict[str, torch.Tensor] = {}  # name -> bf16 copy where the weights live
        self._spare: dict[str, torch.Tensor] = {}  # name -> a second snapshot buffer, while the tensor is busy
        self._digests = {n: tensor_digest(t) for n, t in self._snapshot.items()}
        # hex, as entries carry them (a conversion each way per touched tensor cost ~3 us);
        # then kept up to date in O(changes)
        self._fingerprints = {n: fp.hex() for n, fp in fingerprints_of(self._snapshot).items()}
        self._templates: dict[str, TensorEntry] = {}  # see _entry
        # Sizes by name (shapes never change): publish() and the encoder loop over every tensor
        # right after the optimizer step or a scan of the model has evicted the caches, where a
        # tensor's numel() (its C++ object) cost ~1 us a tensor in misses, an int in a dict less
        self._numel = {n: t.numel() for n, t in self._snapshot.items()}
        self._nbytes = {n: t.numel() * t.element_size() for n, t in self._snapshot.items()}
        self._dense_bytes = sum(self._nbytes.values())
        self._since_anchor_bytes, self._since_anchor = 0, 0
        self._force_anchor = False
        self._broken = False  # an upload failed for good: skip deltas until an anchor lands
        self.errors: list[str] = []
        # One writer per store; taken last, so nothing above can fail while holding it.
        self._lock = WriterLock(self.store, "DeltaPublisher").acquire()
        self._closed = False
        self._finish_lock = threading.Lock()
        self._announcing = 0  # versions uploaded whose replicas have not all answered
        self._notifiers: dict[str, _Notifier] = {}  # url -> its thread, started on first use
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=queue_size)
        self._worker = threading.Thread(target=self._run, name="deltasync-upload", daemon=True)
        self._worker.start()
        # the encoder: one version at a time, and publish() waits for it before detecting again
        self._encode_queue: queue.Queue[_Found | None] = queue.Queue()
        self._encoder_idle = threading.Event()
        self._encoder_idle.set()
        self._encode_error: BaseException | None = None
        self._encoder = threading.Thread(target=self._encode_run, name="deltasync-encode", daemon=True)
        self._encoder.start()
        atexit.register(_close_at_exit, weakref.ref(self))
        try:
            self.version, self._commitment = self._genesis(external_base)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ public
    def publish(self, state: Mapping[str, torch.Tensor] | None = None) -> PublishReport:
        """Encode the change since the last version and queue its upload; returns its report.

        ``state`` gives this version's tensors when the live tensors are not the ones the
        publisher was built on (a trainer that hands out fresh views or gathered shards per sync);
        it must hold the same names, shapes and dtypes.
        """
        if self._closed:
            raise RuntimeError("publish() after close(): this publisher no longer uploads anything")
        self._lock.check()
        t0 = time.perf_counter()
        version = self.version + 1
        live = self._live() if state is None else dict(state)
        if live.keys() != self._snapshot.keys():
            missing, extra = self._snapshot.keys() - live.keys(), live.keys() - self._snapshot.keys()
            raise ValueError(f"publish() needs the same tensors every version: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(extra)[:5]}")
        self._wait_encoder()  # the snapshot is the encoder's until it is done with the last version
        names = sorted(self._snapshot)
        sizes = [self._nbytes[n] for n in names]
        copyable: set[str] = set()
        with torch.no_grad():
            if self.detect == "numba" or (self.detect == "auto" and all(t.device.type == "cpu" for t in live.values())):
                cast = self.dtype == torch.bfloat16
                copyable = {n for n in names if scannable(self._snapshot[n], live[n], cast and live[n].dtype == torch.float32)}
                found = map_batches(lambda batch: self._detect_host(batch, live, copyable), names, sizes)
            else:
                found = map_balanced(lambda n: self._encode_where(n, live[n]), names, sizes)
        report = PublishReport(version=version, kind="delta", changed=0,  # counted by the encoder
                               numel=sum(self._numel.values()), payload_bytes=0,
                               dense_bytes=self._dense_bytes, int32_bf16_bytes=0, encode_s=0.0)
        self.version = version
        self._encoder_idle.clear()
        self._encode_queue.put(_Found(version, dict(zip(names, found)), report, copyable))
        report.encode_s = time.perf_counter() - t0
        return report

    @property
    def commitment(self) -> str:
        """The newest version's commitment (waits for its encoding)."""
        self._wait_encoder(raise_error=False)
        return self._commitment

    @property
    def state_fingerprint(self) -> str:
        """The newest version's state fingerprint (waits for its encoding)."""
        self._wait_encoder(raise_error=False)
        return self._state_fingerprint

    @property
    def state_digest(self) -> str:
        """The newest version's blake3 state digest (waits for its encoding); "" for a delta
        version when ``digests="anchors"``."""
        self._wait_encoder(raise_error=False)
        return self._state_digest

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued version is uploaded and announced."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._encoder_idle.wait(timeout):
            raise TimeoutError("encoding still pending")
        # encode queue first: its count drops only after the version is in the upload queue
        while self._encode_queue.unfinished_tasks or self._queue.unfinished_tasks or self._announcing:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("uploads still pending")
            time.sleep(0.01)

    @property
    def pending(self) -> int:
        """Versions being encoded, queued or uploading."""
        return self._encode_queue.unfinished_tasks + self._queue.unfinished_tasks

    def close(self) -> None:
        """Upload what is queued, stop the upload thread and release the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._encode_queue.put(None)  # encodes (and queues the upload of) the last version first
        self._encoder.join()
        self._queue.put(None)
        self._worker.join()
        for n in list(self._notifiers.values()):  # after the last version was handed to them
            n.close()
        self._lock.release()
        if self.errors:
            log.error("%s: %d version(s) failed to upload: %s", self.store.uri, len(self.errors), "; ".join(self.errors))

    def __enter__(self) -> DeltaPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _live(self) -> dict[str, torch.Tensor]:
        return module_state(self.model) if isinstance(self.model, torch.nn.Module) else dict(self.model)

    def _cast(self, t: torch.Tensor, host: bool = True) -> torch.Tensor:
        t = t.detach()
        if self.dtype is not None and t.is_floating_point() and t.dtype != self.dtype:
            t = t.to(self.dtype)
        return (t.cpu() if host else t).contiguous()

    def _detect_host(self, names: list[str], live: Mapping[str, torch.Tensor],
                     copyable: set[str]) -> list[EncodedTensor | Changes | _Copied]:
        """Host tensors' changes against the snapshot, which they refresh in place: the host
        tensors that need no cast, and fp32 weights published as bf16 (the cast inside the
        compare), in one kernel call each; the rest (another dtype or layout, NaN weights) one by
        one. A busy tensor (it has a spare buffer) and one whose scan found it dense are copied
        instead (:meth:`_copy_in`), and the encoder finds their change."""
        cast = self.dtype == torch.bfloat16
        to_cast = {n for n in names if cast and live[n].dtype == torch.float32}
        busy = {n for n in names if n in self._spare and n in copyable}
        fused = [n for n in names if n in to_cast and n not in busy]
        plain = [n for n in names if live[n].dtype == self._snapshot[n].dtype and n not in busy]
        found = dict(zip(fused, find_changes_many([(self._snapshot[n], live[n]) for n in fused], update=True,
                                                  cast=True)))
        found.update(zip(plain, find_changes_many([(self._snapshot[n], live[n]) for n in plain],
                                                  update=True)))
        found.update((n, None) for n in busy)
        return [self._detected(n, found.get(n, False), live[n]) for n in names]

    def _detected(self, name: str, changes: Changes | None | bool,
                  live: torch.Tensor) -> EncodedTensor | Changes | _Copied:
        """What :meth:`_detect_host` found for one tensor: its changes, a copy for the encoder
        (None: busy, or dense, whose scan stopped at its cap and left the snapshot as it was), or
        with no result (False) the one-tensor path, which casts with torch where needed."""
        snap = self._snapshot[name]
        if changes is None:
            return self._copy_in(name, live)
        if changes is not False:
            return changes if changes.count else self._unchanged(name)
        return detect_tensor(name, snap, self._cast(live), update=True, threads=False,
                             same_digest=self._kept_digest(name))

    def _unchanged(self, name: str) -> EncodedTensor:
        """A tensor's entry when nothing in it changed: the base's fingerprint and digest."""
        entry = tensor_entry(self._snapshot[name], self._kept_digest(name), self._fingerprints[name])
        return EncodedTensor(entry, {})

    def _kept_digest(self, name: str) -> str:
        """The digest an untouched tensor's entry carries: the base's where deltas carry digests,
        else none (clearing it after the coding cost ~2 us an untouched tensor)."""
        return self._digests[name] if self.digests == "every" else ""

    def _copy_in(self, name: str, live: torch.Tensor) -> _Copied:
        """The live bits (cast as :meth:`_cast` does) copied into the tensor's spare buffer, which
        becomes the snapshot; the old snapshot becomes the spare, holding the old bits until the
        encoder is done with them (before the next publish() copies into it again). A first
        spare costs a page fault per 4 KiB, the same as the XOR buffer a dense pass would need."""
        spare = self._spare.get(name)
        if spare is None:
            spare = torch.empty_like(self._snapshot[name])
        spare.copy_(live.detach())
        self._snapshot[name], self._spare[name] = spare, self._snapshot[name]
        return _Copied(self._spare[name])

    def _wait_encoder(self, raise_error: bool = True) -> None:
        self._encoder_idle.wait()
        if raise_error and self._encode_error is not None:
            raise RuntimeError(f"a version could not be encoded, so this publisher cannot go on: "
                               f"{self._encode_error!r}") from self._encode_error

    def _encode_run(self) -> None:
        while (job := self._encode_queue.get()) is not None:
            try:
                upload = self._encode(job)
            except BaseException as e:  # kept for the next publish() to raise
                log.exception("encoding v%d failed", job.version)
                self._encode_error = e
                job.report.kind, job.report.error = "failed", f"encoding failed: {e!r}"
                self.errors.append(f"v{job.version}: {job.report.error}")
                job.report._encoded.set()
                self._finish(job.report)
                self._encoder_idle.set()
                self._encode_queue.task_done()
                continue
            job.report._encoded.set()
            self._encoder_idle.set()  # the snapshot is free: the next publish() may detect
            self._put(upload)  # blocks while uploads are behind by queue_size versions
            self._encode_queue.task_done()  # only now: flush() must not see a gap between the queues

    def _encode(self, job: _Found) -> _Job:
        """Encode one version from the snapshot, build its delta (and an anchor when the policy
        wants one) and advance the chain's commitment."""
        t0 = time.perf_counter()
        names = list(job.found)
        self._resolve_copies(job.found, job.copyable)
        t_resolved = time.perf_counter()
        changed = sum(_changed(f) for f in job.found.values())
        job.report.changed, job.report.int32_bf16_bytes = changed, 6 * changed  # set, not read: that waits for this

        def one(n: str) -> EncodedTensor:
            found = job.found[n]
            if isinstance(found, EncodedTensor) and found.entry.fingerprint:  # unchanged: nothing to do
                return found
            return encode_found(n, self._snapshot[n], found, compact=self.compact,
                                base_fingerprint=Fingerprint.from_hex(self._fingerprints[n]), digest=self._new_digest())

        def batch(members: list[str]) -> list[EncodedTensor]:
            """The sparse changes coded in one call per element width (unless ``compact``, which
            codes each against its base), the rest one by one."""
            sparse = {} if self.compact else {n: job.found[n] for n in members if isinstance(job.found[n], Changes)}
            coded = {}
            for changes in change_batches(sparse, self._snapshot):
                fingerprints = fingerprints_after(changes, self._fingerprints)
                coded.update(zip(changes.names, encode_changes_many(
                    changes, [self._entry(n) for n in changes.names], [fingerprints[n] for n in changes.names])))
            return [coded[n] if n in coded else one(n) for n in members]

        work = [_encode_work(job.found[n], self._numel[n]) for n in names]
        encoded = dict(zip(names, map_batches(batch, names, work, serial_below=THREADS_FROM_CHANGES)))
        t_coded = time.perf_counter()
        if self.digests == "every":
            for n, e in encoded.items():
                if not e.entry.digest:  # unknown since versions published with digests="anchors"
                    e.entry.digest = tensor_digest(self._snapshot[n])
            self._digests.update({n: e.entry.digest for n, e in encoded.items()})
        else:  # a digest stays known only while its tensor is untouched; the delta names none
            for n, e in encoded.items():
                if e.entry.encoding != "same":
                    self._digests[n] = ""
                if e.entry.digest:  # (an attribute set on a pydantic model costs ~2 us)
                    e.entry.digest = ""
        self._fingerprints.update({n: e.entry.fingerprint for n, e in encoded.items() if e.entry.encoding != "same"})
        version, base_version, report = job.version, job.version - 1, job.report
        header, tensors = build_delta(encoded, version=version, base_version=base_version,
                                      base_commitment=self._commitment, base_state_digest=self._state_digest)
        t_built = time.perf_counter()
        delta = save_delta(header, tensors)
        t_saved = time.perf_counter()
        report.payload_bytes, report.commitment = len(delta), header.commitment
        objects: dict[str, bytes | Path] = {delta_key(base_version, version): delta}
        refs = [ref_for("delta", header, delta_key(base_version, version), delta)]
        self._since_anchor_bytes += len(delta)
        self._since_anchor += 1
        tmp, anchor_s = None, 0.0
        if self._force_anchor or self.policy.wants_anchor(self._since_anchor_bytes, self._dense_bytes,
                                                          self._since_anchor):
            a = time.perf_counter()
            tmp, path, aheader = self._write_anchor(version, base_version, self._commitment)
            anchor_s = time.perf_counter() - a
            assert aheader.commitment == header.commitment
            objects[anchor_key(version)] = path
            refs.append(ref_for("anchor", aheader, anchor_key(version), path))
            report.kind = "delta+anchor"
            self._since_anchor_bytes, self._since_anchor, self._force_anchor = 0, 0, False
            header = aheader  # the same version, and its manifest gets the anchor's state digest
        self._commitment, self._state_fingerprint = header.commitment, header.state_fingerprint
        self._state_digest = header.state_digest
        report.state_fingerprint, report.state_digest = header.state_fingerprint, header.state_digest
        report.encoder_s = time.perf_counter() - t0
        report.encoder_parts = {"resolve_s": t_resolved - t0, "code_s": t_coded - t_resolved,
                                "header_s": t_built - t_coded, "file_s": t_saved - t_built, "anchor_s": anchor_s}
        return _Job(header, objects, refs, report, tmp)

    def _resolve_copies(self, found: dict[str, EncodedTensor | Changes | DenseChange | _Copied],
                        copyable: set[str]) -> None:
        """The changes of the tensors publish() copied, in place of their :class:`_Copied`: a scan
        of the old bits against the snapshot (one kernel call per batch), and where that finds the
        change dense, the XOR written over the old bits, which are not needed after it. Then the
        spares follow what each tensor did: kept (or, for a tensor that just got busy, made and
        touched here, off the training loop) while it changes in ``copy_from`` of its elements or
        more, dropped when it calms down."""
        copied = [n for n, f in found.items() if isinstance(f, _Copied)]

        def scan(batch: list[str]) -> list[Changes | None | bool]:
            pairs = [(found[n].old, self._snapshot[n]) for n in batch]
            return [find_changes(*pair, threads=False) if got is False else got
                    for pair, got in zip(pairs, find_changes_many(pairs))]

        for n, changes in zip(copied, map_batches(scan, copied, [self._numel[n] for n in copied],
                                                  serial_below=THREADS_FROM_CHANGES)):
            snap = self._snapshot[n]
            if changes is None:
                found[n] = full_pass_change(found[n].old, snap, out=unsigned_view(found[n].old))
            else:
                found[n] = changes if changes.count else self._unchanged(n)
        for n, f in found.items():
            if not self._busy(_changed(f), self._numel[n]):
                self._spare.pop(n, None)
            elif n in copyable and n not in self._spare:
                self._spare[n] = torch.zeros_like(self._snapshot[n])

    def _busy(self, changed: int, numel: int) -> bool:
        """Whether a tensor with ``changed`` of ``numel`` elements changed is copied next version:
        ``copy_from`` of it or more changed, and something did unless ``copy_from`` is 0."""
        return changed >= self.copy_from * numel and (changed > 0 or self.copy_from == 0)

    def _new_digest(self) -> str | None:
        """The ``digest`` argument of the encoders for a touched tensor: None (compute it) or ""
        (leave it out, digests="anchors")."""
        return None if self.digests == "every" else ""

    def _entry(self, name: str) -> TensorEntry:
        """A touched tensor's entry before its coding and fingerprint: the snapshot's (already the
        new state) with its digest where digests="every", else a template kept per tensor (its
        dtype and shape never change; the coder copies it)."""
        if self.digests == "every":
            return tensor_entry(self._snapshot[name], None)
        if name not in self._templates:
            self._templates[name] = tensor_entry(self._snapshot[name], "")
        return self._templates[name]

    def _encode_where(self, name: str, live: torch.Tensor) -> EncodedTensor:
        """One tensor's change, found on the device that holds it (the host snapshot follows)."""
        host = self._snapshot[name]
        base_fp = Fingerprint.from_hex(self._fingerprints[name])
        if self.detect == "auto" and live.device.type == "cpu":
            return encode_tensor(name, host, self._cast(live), update=True, threads=False, compact=self.compact,
                                 base_fingerprint=base_fp, digest=self._new_digest())
        new = self._cast(live, host=False)
        snap = self._device_snapshot.get(name)
        if snap is None or snap.device != new.device:  # first version here: the base crosses once
            snap = self._device_snapshot[name] = host.to(new.device, copy=True)
        if new.shape == snap.shape and new.dtype == snap.dtype:
            if new.dtype in INT_VIEW:
                changes = find_changes(snap, new, update=True, backend="torch")
                if changes is not None:
                    return self._encode_found(name, host, changes)
            elif torch.equal(snap, new):
                return encode_tensor(name, host, host, digest=self._kept_digest(name), base_fingerprint=base_fp)
        # a dense change, a dtype without a bit view, or a shape error: the whole tensor crosses
        enc = encode_tensor(name, host, new.cpu(), update=True, threads=False, compact=self.compact,
                            digest=self._new_digest())
        snap.copy_(new)
        return enc

    def _encode_found(self, name: str, host: torch.Tensor, changes: Changes) -> EncodedTensor:
        """``encode_tensor``'s sparse case from changes found elsewhere: the host snapshot holds
        the old bits, so the new ones come from the XORs and never cross the bus themselves."""
        hv = unsigned_view(host)
        pos, xor = changes.positions, changes.xor
        if changes.count == 0:
            return self._unchanged(name)
        old_at = hv[pos]
        new_at = old_at ^ xor
        classed = encode_positions_classed(pos, hv, host.dtype) if self.compact else None  # on the base
        hv[pos] = new_at
        fp = Fingerprint.from_hex(self._fingerprints[name]) + fingerprint_delta(pos, old_at, new_at,
                                                                                 host.element_size() * 8)
        return encode_changes(self._entry(name).model_copy(update={"fingerprint": fp.hex()}), name, pos, xor,
                              lambda k=None: new_at[:k],
                              None if classed is None else lambda: classed)

    def _write_anchor(self, version: int, base_version: int | None, base_commitment: str):
        tmp = tempfile.TemporaryDirectory(prefix="deltasync-anchor-")
        path = Path(tmp.name) / "anchor.safetensors"
        # blake3 of the tensors touched since they were last hashed (digests="anchors"): O(model), per anchor
        missing = [n for n, d in self._digests.items() if not d]
        self._digests.update(zip(missing, map_balanced(lambda n: tensor_digest(self._snapshot[n]), missing,
                                                       [self._numel[n] for n in missing])))
        header = anchor_header(self._snapshot, version=version, base_version=base_version,
                               base_commitment=base_commitment, digests=self._digests,
                               fingerprints=self._fingerprints)
        save_anchor(self._snapshot, path, header)
        return tmp, path, header

    def _genesis(self, external_base: str | None) -> tuple[int, str]:
        header = anchor_header(self._snapshot, version=0, digests=self._digests, fingerprints=self._fingerprints)
        self._state_digest, self._state_fingerprint = header.state_digest, header.state_fingerprint
        latest = self.chain.latest()
        if latest is not None:
            m = self.chain.manifest(latest.version)
            if m.state_fingerprint != header.state_fingerprint:
                raise ValueError(f"{self.store.uri} already holds a chain at v{latest.version} whose "
                                 "state differs from this model; use an empty store or prefix")
            log.info("continuing the chain in %s at v%d", self.store.uri, latest.version)
            if unfinished := self.chain.discard_unfinished():  # we hold the lock: its writer is gone
                log.warning("%s: discarded v%s, published past latest (v%d) by a writer that never "
                            "finished", self.store.uri, ", v".join(map(str, unfinished)), latest.version)
            self._since_anchor_bytes, self._since_anchor = self._catchup_since_anchor(latest.version)
            return latest.version, latest.commitment
        report = PublishReport(version=0, kind="anchor", changed=header.numel, numel=header.numel,
                               payload_bytes=0, dense_bytes=self._dense_bytes,
                               int32_bf16_bytes=6 * header.numel, encode_s=0.0,
                               commitment=header.commitment, state_fingerprint=header.state_fingerprint,
                               state_digest=header.state_digest)
        report._encoded.set()
        if external_base:
            ref = ObjectRef(kind="anchor", version=0, external=external_base)
            self._put(_Job(header, {}, [ref], report))
        else:
            tmp, path, _ = self._write_anchor(0, None, "")
            report.payload_bytes = path.stat().st_size
            self._put(_Job(header, {anchor_key(0): path},
                           [ref_for("anchor", header, anchor_key(0), path)], report, tmp))
        return 0, header.commitment

    def _catchup_since_anchor(self, version: int) -> tuple[int, int]:
        """Delta bytes and count since the newest anchor, for an anchor policy that resumes."""
        total, count = 0, 0
        for v in range(version, -1, -1):
            m = self.chain.manifest(v)
            if m.object("anchor") is not None:
                break
            d = m.object("delta")
            total, count = total + (d.size if d else 0), count + 1
        return total, count

    def _put(self, job: _Job) -> None:
        self._queue.put(job)  # blocks while uploads are behind by queue_size versions

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            anchored = any(r.kind == "anchor" for r in job.refs)
            try:
                if self._broken and not anchored:
                    job.report.kind = "skipped"  # its base never landed; an anchor follows
                    job.report.error = "its base version never landed; a later version anchors"
                else:
                    if self._broken:  # heal: this version's delta starts from a version that never landed
                        job.refs = [r for r in job.refs if r.kind == "anchor"]
                        job.objects = {k: v for k, v in job.objects.items() if k.startswith("anchors/")}
                        job.report.kind = "anchor"
                    self._lock.check()
                    self._upload(job)
                    self._broken = False
                    # replicas start on (or catch up to) v0; the replica that answers last finishes it
                    if job.report.version > 0 and self._announce(job.report):
                        job.report = None
            except Exception as e:  # keep the chain whole: skip to the next anchor
                log.exception("upload of v%d failed for good; the next version anchors",
                              job.header.version)
                self.errors.append(f"v{job.header.version}: {e}")
                job.report.kind, job.report.error = "failed", str(e)
                self._broken = self._force_anchor = True
            finally:
                if job.tmpdir is not None:
                    job.tmpdir.cleanup()
                if job.report is not None:
                    self._finish(job.report)
                self._queue.task_done()

    def _announce(self, report: PublishReport) -> bool:
        """Hand a landed version to every replica's notifier; False when there is none."""
        urls = list(dict.fromkeys(self.replicas))  # ``replicas`` may change between versions
        if not urls:
            return False
        for url in urls:
            if url not in self._notifiers:
                self._notifiers[url] = _Notifier(self, url)
        with self._finish_lock:
            self._announcing += 1
            report._waiting = len(urls)
        report._notify_t0 = time.perf_counter()
        for url in urls:
            self._notifiers[url].queue.put(report)
        return True

    def _answered(self, report: PublishReport, url: str, answer: dict) -> None:
        with self._finish_lock:
            report.replicas[url] = answer
            report._waiting -= 1
            last = report._waiting == 0
        if last:
            report.notify_s = time.perf_counter() - report._notify_t0
            self._finish(report)
            with self._finish_lock:
                self._announcing -= 1

    def _finish(self, report: PublishReport) -> None:
        with self._finish_lock:
            bisect.insort(self.reports, report, key=lambda r: r.version)
        if self.on_report:
            try:
                self.on_report(report)
            except Exception:  # a caller's callback must not stop the uploads
                log.exception("on_report failed for v%d", report.version)
        report._done.set()

    def _upload(self, job: _Job) -> None:
        t0 = time.perf_counter()
        for attempt in range(self.retries + 1):
            try:
                self.chain.publish(job.header, job.objects, job.refs, changed=job.report.changed,
                                   dense_bytes=job.report.dense_bytes)
                break
            except Exception as e:
                if attempt == self.retries or (isinstance(e, DeltaError) and e.reason in ("conflict", "locked")):
                    raise
                log.warning("upload of v%d failed (%s); retrying", job.header.version, e)
                time.sleep(self.backoff_s * 2**attempt)
        if any(r.kind == "anchor" for r in job.refs) and job.header.version > 0:
            try:
                job.report.dropped = self.chain.retain(self.keep_anchors)
            except Exception:  # the version landed; old versions stay until the next anchor
                log.exception("%s: retention after v%d failed", self.store.uri, job.header.version)
            if job.report.dropped:
                log.info("%s: retention (keep_anchors=%d) deleted v%d..v%d", self.store.uri, self.keep_anchors,
                         job.report.dropped[0], job.report.dropped[-1])
        job.report.upload_s = time.perf_counter() - t0

    def _notify_one(self, client: httpx.Client, url: str, version: int, headers: dict) -> dict:
        for attempt in range(self.retries + 1):
            try:
                r = client.post(f"{url.rstrip('/')}/update", json={"version": version}, headers=headers)
                if r.status_code < 500:
                    try:
                        body = r.json()
                    except ValueError:
                        body = {"text": r.text[:500]}
                    return body if r.is_success else {"error": f"HTTP {r.status_code}", "body": body}
                err = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                err = f"{type(e).__name__}: {e}"
            log.warning("notify %s of v%d failed (%s)", url, version, err)
            if attempt < self.retries:
                time.sleep(self.backoff_s * 2**attempt)
        return {"error": f"unreachable: {err}"}


class _Notifier:
    """One replica's notifications: a thread that posts each landed version's ``/update`` in
    version order, so that a replica that hangs only ever delays itself."""

    def __init__(self, pub: DeltaPublisher, url: str):
        self.pub, self.url = pub, url
        self.queue: queue.Queue[PublishReport | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"deltasync-notify-{url}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        pub = self.pub
        headers = {"Authorization": f"Bearer {pub.token}"} if pub.token else {}
        with httpx.Client(timeout=pub.notify_timeout_s) as client:
            while (report := self.queue.get()) is not None:
                try:
                    answer = pub._notify_one(client, self.url, report.version, headers)
                except Exception as e:  # never leave a report waiting for this replica
                    log.exception("notify %s of v%d failed", self.url, report.version)
                    answer = {"error": f"{type(e).__name__}: {e}"}
                pub._answered(report, self.url, answer)

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()


def _close_at_exit(ref: weakref.ref) -> None:
    """A script that ends without ``close()`` still uploads its last versions, and says so."""
    pub = ref()
    if pub is not None and not pub._closed:
        if pub.pending:
            log.warning("%s: DeltaPublisher was not closed; uploading %d pending version(s) before exit",
                        pub.store.uri, pub.pending)
        pub.close()
