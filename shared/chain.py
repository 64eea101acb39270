"""A version chain in a store: layout, publish protocol, catch-up planning, anchors, retention.

Layout below the store root::

    anchors/v00000012.safetensors     full state of version 12 (also a loadable checkpoint)
    deltas/v00000013.safetensors      version 12 -> 13
    deltas/v00000010-v00000013.safetensors   a squashed delta 10 -> 13
    manifests/v00000013.json          what version 13 is and which objects reach it
    latest.json                       {"version": 13, "commitment": ...}, written last

Uploads are not transactional, so the publish order makes a version appear whole: objects, then
the manifest, then ``latest.json``. A reader starts from ``latest.json`` (or a manifest) and only
ever follows references to objects that were complete before the reference was written.
"""

from __future__ import annotations

import heapq
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import blake3
import torch
from pydantic import BaseModel, ValidationError, field_validator

from .codec import DeltaFile, Header, read_header
from .digest import file_digest
from .errors import DeltaError, first_line
from .stores import Store

LATEST = "latest.json"
OBJECT_FOLDERS = ("anchors", "deltas")


def _v(version: int) -> str:
    return f"v{version:08d}"


def anchor_key(version: int) -> str:
    return f"anchors/{_v(version)}.safetensors"


def delta_key(base_version: int, version: int) -> str:
    span = _v(version) if base_version == version - 1 else f"{_v(base_version)}-{_v(version)}"
    return f"deltas/{span}.safetensors"


def manifest_key(version: int) -> str:
    return f"manifests/{_v(version)}.json"


class ObjectRef(BaseModel):
    """One object that reaches ``version``: an anchor (from nothing) or a delta (from base_version)."""

    kind: Literal["anchor", "delta"]
    version: int
    base_version: int | None = None
    key: str | None = None  # None: an external anchor, not in the store
    external: str | None = None  # model id or path of a checkpoint everyone can already load
    size: int = 0
    blake3: str | None = None

    @field_validator("key")
    @classmethod
    def _below_objects(cls, key: str | None) -> str | None:
        """An object lies in ``anchors/`` or ``deltas/``, as a plain relative path: a manifest
        that names anything else (``..``, an absolute path, a manifest, ``latest.json``) is refused
        when read, so retention can never delete outside the chain's objects."""
        if key is None:
            return key
        top, _, rest = key.partition("/")
        parts = rest.split("/")
        if (top not in OBJECT_FOLDERS or not rest or "\\" in key or "\0" in key or
                any(part in ("", ".", "..") for part in parts)):
            raise ValueError(f"object key {key!r} is not a path below {' or '.join(f'{d}/' for d in OBJECT_FOLDERS)}")
        return key


class Manifest(BaseModel):
    version: int
    commitment: str
    base_commitment: str
    state_fingerprint: str
    state_digest: str = ""  # blake3; "" for a delta version published without digests
    created: float
    objects: list[ObjectRef]
    changed: int = 0  # elements changed since the previous version
    numel: int = 0
    dense_bytes: int = 0

    def object(self, kind: str) -> ObjectRef | None:
        return next((o for o in self.objects if o.kind == kind and
                     (kind == "anchor" or o.base_version == self.version - 1)), None)


class Latest(BaseModel):
    version: int
    commitment: str


@dataclass
class AnchorPolicy:
    """Anchor when a late replica's catch-up (delta bytes since the last anchor) would exceed
    ``catchup_fraction`` of a full anchor, rather than every N versions: sparse steps then
    anchor rarely, dense ones often, and catch-up never costs more than that fraction."""

    catchup_fraction: float = 0.5
    max_deltas: int | None = None

    def wants_anchor(self, delta_bytes_since_anchor: int, anchor_bytes: int, deltas_since: int) -> bool:
        if self.max_deltas is not None and deltas_since >= self.max_deltas:
            return True
        return delta_bytes_since_anchor > self.catchup_fraction * anchor_bytes


def _check(ref: ObjectRef, size: int, digest: str) -> None:
    if size != ref.size or digest != ref.blake3:
        raise DeltaError("corrupt", f"{ref.key}: {size} bytes that do not match the manifest")


def _one_line(e: ValueError) -> str:
    """A schema error as one line (the field and what is wrong), not pydantic's three."""
    if isinstance(e, ValidationError) and (errors := e.errors()):
        where = ".".join(str(p) for p in errors[0]["loc"]) or "the document"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        return f"{where}: {errors[0]['msg']}{more}"
    return first_line(e)


def ref_for(kind: Literal["anchor", "delta"], header: Header, key: str, data: bytes | Path) -> ObjectRef:
    if isinstance(data, bytes):
        size, digest = len(data), blake3.blake3(data).hexdigest()
    else:  # an anchor file
        size, digest = Path(data).stat().st_size, file_digest(data)
    return ObjectRef(kind=kind, version=header.version, base_version=header.base_version, key=key,
                     size=size, blake3=digest)


class Chain:
    """Reads and writes one version chain. Manifests are cached: they only ever gain objects.

    An object that failed its check against its manifest or was missing is remembered (by key and
    blake3, so a new object under the same key is not), and :meth:`plan` routes around it while
    another route exists: a reader that met a damaged delta plans through an anchor next time.
    """

    def __init__(self, store: Store):
        self.store = store
        self._manifests: dict[int, Manifest] = {}
        self._failed: set[tuple[str, str | None]] = set()  # (key, blake3) that failed or were missing

    # ------------------------------------------------------------------ read
    def latest(self) -> Latest | None:
        """None for a store with no version yet; a ``latest.json`` that cannot be read is refused."""
        try:
            raw = self.store.get(LATEST)
        except DeltaError:
            return None
        try:
            return Latest.model_validate_json(raw)
        except ValueError as e:
            raise DeltaError("format", f"{LATEST}: {_one_line(e)}") from None

    def manifest(self, version: int, *, refresh: bool = False) -> Manifest:
        if refresh or version not in self._manifests:
            raw = self.store.get(manifest_key(version))
            try:
                self._manifests[version] = Manifest.model_validate_json(raw)
            except ValueError as e:
                raise DeltaError("format", f"manifest v{version}: {_one_line(e)}") from None
        return self._manifests[version]

    def _agrees(self, ref: ObjectRef, header: Header) -> None:
        """An object whose bytes match its manifest entry can still hold another version (a
        manifest written against the wrong file): its header must name what the manifest does."""
        m = self.manifest(ref.version)
        said = (header.kind, header.version, header.commitment, header.state_fingerprint)
        if said != (ref.kind, ref.version, m.commitment, m.state_fingerprint) or (
                header.state_digest and m.state_digest and header.state_digest != m.state_digest) or (
                ref.kind == "delta" and header.base_version != ref.base_version):
            raise DeltaError("corrupt", f"{ref.key} holds {header.kind} v{header.version} (commitment "
                                        f"{header.commitment[:12]}), not the {ref.kind} of v{ref.version} that "
                                        f"manifest v{ref.version} names (commitment {m.commitment[:12]})")

    def forget(self, version: int | None = None) -> None:
        """Drop cached manifests (one, or all), e.g. after a refused object was re-uploaded."""
        if version is None:
            self._manifests.clear()
        else:
            self._manifests.pop(version, None)

    def versions(self) -> list[int]:
        return sorted(int(Path(k).stem[1:]) for k in self.store.list("manifests") if k.endswith(".json"))

    def fetch_bytes(self, ref: ObjectRef) -> bytes:
        if ref.key is None:
            raise DeltaError("missing", f"v{ref.version} is the external checkpoint {ref.external!r}")
        with self._checking(ref):
            data = self.store.get(ref.key)
            _check(ref, len(data), blake3.blake3(data).hexdigest())
        return data

    @contextmanager
    def _checking(self, ref: ObjectRef) -> Iterator[None]:
        """Remember whether ``ref`` could be fetched whole (see :meth:`plan`)."""
        try:
            yield
        except DeltaError as e:
            if e.reason in ("missing", "corrupt"):
                self._failed.add((ref.key or "", ref.blake3))
            raise
        self._failed.discard((ref.key or "", ref.blake3))

    def fetch(self, ref: ObjectRef) -> DeltaFile:
        """Download and check an object against its manifest entry, then parse it."""
        f = DeltaFile.from_bytes(self.fetch_bytes(ref))
        with self._checking(ref):
            self._agrees(ref, f.header)
        return f

    def download(self, ref: ObjectRef, path: str | Path) -> Path:
        """Download an object to a file, checked against its manifest entry without ever holding
        it in memory whole (anchors are as large as the model)."""
        if ref.key is None:
            raise DeltaError("missing", f"v{ref.version} is the external checkpoint {ref.external!r}")
        with self._checking(ref):
            path = self.store.download(ref.key, path)
            try:
                _check(ref, path.stat().st_size, file_digest(path))
                self._agrees(ref, read_header(path))
            except DeltaError:
                path.unlink(missing_ok=True)
                raise
        return path

    def plan(self, from_version: int | None, to_version: int,
             from_commitment: str | None = None) -> list[ObjectRef]:
        """Cheapest list of objects (by bytes) from ``from_version`` to ``to_version``.

        Starting points are the held version (free, if its commitment matches the chain's) and
        every anchor at or before the target (costing its size; an external anchor costs nothing
        to download but only helps a replica that already holds it, so it is used only when
        nothing else reaches the target). Objects that failed their check or were missing when
        last fetched are left out while any route avoids them (e.g. through an anchor); when none
        does they are tried again, since they may have been repaired since.
        """
        target = self.manifest(to_version)
        if from_version is not None and from_version == to_version:
            return []
        lo = min(from_version if from_version is not None else to_version, to_version)
        known = [v for v in self.versions() if v <= to_version]
        edges: dict[int, list[ObjectRef]] = {}
        starts: list[tuple[float, int, list[ObjectRef]]] = []
        for v in known:
            m = self.manifest(v)
            for o in m.objects:
                if o.kind == "anchor":
                    cost = o.size if o.key else float(1 << 62)
                    starts.append((cost, v, [o]))
                elif o.base_version is not None:
                    edges.setdefault(o.base_version, []).append(o)
        held_ok = (from_version is not None and from_version in known and
                   (from_commitment is None or self.manifest(from_version).commitment == from_commitment))
        if held_ok:
            starts.append((0, from_version, []))
        for avoid in ([set(self._failed)] if self._failed else []) + [set()]:
            path = _cheapest(starts, edges, to_version, avoid)
            if path is not None:
                return path
        raise DeltaError("missing", f"no chain of objects reaches v{target.version} from "
                         f"{'nothing' if from_version is None else f'v{from_version}'} (lowest v{lo})")

    # ------------------------------------------------------------------ write
    def publish(self, header: Header, objects: dict[str, bytes | Path], refs: list[ObjectRef], *,
                numel: int = 0, changed: int = 0, dense_bytes: int = 0) -> Manifest:
        """Upload ``objects`` (key -> data), then the manifest, then move ``latest`` (last).

        Refuses (``conflict``), before writing anything, when ``latest`` is already past this
        version or this version's manifest exists with another commitment: a second writer, or an
        unfinished publish that ``deltasync fsck --repair`` clears. A retry of this very publish
        (same commitment) finds its own manifest or ``latest`` and completes; where the manifest
        is there, so is every object it names, and those are kept: a new encoding of the same
        version need not have the same bytes (safetensors writes its metadata in no fixed order),
        and the manifest holds the first one's digests.
        """
        def conflict(why: str) -> DeltaError:
            return DeltaError("conflict", f"{self.store.uri}: {why}, cannot publish v{header.version} (another "
                              f"writer, or an unfinished publish: run `deltasync fsck {self.store.uri} --repair`)")

        latest = self.latest()
        if latest is not None and latest.version >= header.version:
            if latest.version == header.version and latest.commitment == header.commitment:
                return self.manifest(header.version, refresh=True)  # an earlier attempt got this far
            raise conflict(f"latest is already v{latest.version}")
        key = manifest_key(header.version)
        m = self.manifest(header.version, refresh=True) if self.store.exists(key) else None
        if m is not None and m.commitment != header.commitment:
            raise conflict(f"v{header.version} already exists with other contents")
        if m is None:
            for obj_key, data in objects.items():
                self.store.put(obj_key, data)
            m = Manifest(version=header.version, commitment=header.commitment,
                         base_commitment=header.base_commitment,
                         state_fingerprint=header.state_fingerprint, state_digest=header.state_digest,
                         created=time.time(), objects=refs, changed=changed, numel=numel or header.numel,
                         dense_bytes=dense_bytes or header.dense_bytes)
            if not self.store.create(key, m.model_dump_json(indent=1).encode()):
                held = self.manifest(m.version, refresh=True)
                if held.commitment != m.commitment:
                    raise conflict(f"v{m.version} appeared with other contents meanwhile")
                m = held
        self._manifests[m.version] = m
        self.store.put(LATEST, Latest(version=m.version, commitment=m.commitment).model_dump_json().encode())
        return m

    def discard_unfinished(self) -> list[int]:
        """Delete the manifests past ``latest``: a publish whose writer died between the manifest
        and ``latest.json``, so that the next writer can publish that version with its own
        contents instead of being refused (``conflict``). Only the store's writer, holding
        ``writer.lock``, may call this. The objects those manifests named stay until
        ``deltasync fsck --repair`` (or the next publish of their keys) replaces them."""
        latest = self.latest()
        if latest is None:
            return []
        unfinished = [v for v in self.versions() if v > latest.version]
        for v in unfinished:
            self.store.delete(manifest_key(v))
            self._manifests.pop(v, None)
        return unfinished

    def add_object(self, version: int, key: str, data: bytes | Path, ref: ObjectRef) -> Manifest:
        """Attach another object (a squashed delta, a later anchor) to an existing version."""
        self.store.put(key, data)
        m = self.manifest(version, refresh=True)
        m.objects = [o for o in m.objects if o.key != key] + [ref]
        self.store.put(manifest_key(version), m.model_dump_json(indent=1).encode())
        return m

    def retain(self, keep_anchors: int = 2) -> list[int]:
        """Drop versions older than the ``keep_anchors``-th newest anchor. Manifests go first, so
        no reader plans through an object that is about to disappear. Returns dropped versions."""
        versions = self.versions()
        anchored = [v for v in versions if self.manifest(v).object("anchor") is not None]
        if len(anchored) <= keep_anchors:
            return []
        floor = anchored[-keep_anchors]
        dropped = [v for v in versions if v < floor]
        doomed = [o.key for v in dropped for o in self.manifest(v).objects if o.key]
        # squashed deltas that start before the floor but are listed under a kept version
        for v in versions:
            if v >= floor:
                m = self.manifest(v)
                stale = [o for o in m.objects if o.kind == "delta" and (o.base_version or 0) < floor]
                if stale:
                    m.objects = [o for o in m.objects if o not in stale]
                    self.store.put(manifest_key(v), m.model_dump_json(indent=1).encode())
                    doomed += [o.key for o in stale if o.key]
        for v in dropped:
            self.store.delete(manifest_key(v))
            self._manifests.pop(v, None)
        for key in doomed:
            self.store.delete(key)
        return dropped


def _cheapest(starts: list[tuple[float, int, list[ObjectRef]]], edges: dict[int, list[ObjectRef]], to_version: int,
              avoid: set[tuple[str, str | None]]) -> list[ObjectRef] | None:
    """Dijkstra over versions: the cheapest object list reaching ``to_version`` that uses no
    object in ``avoid``, or None."""
    def usable(o: ObjectRef) -> bool:
        return o.key is None or (o.key, o.blake3) not in avoid

    best: dict[int, float] = {}
    heap = [(c, v, i, path) for i, (c, v, path) in enumerate(starts) if all(usable(o) for o in path)]
    heapq.heapify(heap)
    tie = len(heap)
    while heap:
        cost, v, _, path = heapq.heappop(heap)
        if v == to_version:
            return path
        if best.get(v, float("inf")) <= cost:
            continue
        best[v] = cost
        for o in edges.get(v, []):
            if o.version <= to_version and usable(o):
                tie += 1
                heapq.heappush(heap, (cost + o.size, o.version, tie, path + [o]))
    return None


def reconstruct(chain: Chain, version: int | None = None, *, progress: bool = False,
                base: str | Path | Mapping[str, torch.Tensor] | None = None,
                ) -> tuple[dict[str, torch.Tensor], Header]:
    """Rebuild the exact state of ``version`` (default: latest) from the store, verified.

    A chain whose genesis is an external checkpoint (``DeltaPublisher(external_base=...)``)
    needs that checkpoint: ``base`` is a local copy of it (a checkpoint file or folder, e.g. a
    downloaded Hub snapshot) or its state (name -> tensor). Without ``base`` the manifest's
    ``external`` is loaded when it is a local path; a Hub id is refused (``missing``), naming it.
    Either way the base must have the chain's state digest (``wrong_base`` otherwise). ``base`` is
    not used when the store's own anchors reach ``version``. An object found damaged or missing
    is routed around (``Chain.plan``) when another route reaches ``version``.
    """
    if version is None:
        latest = chain.latest()
        if latest is None:
            raise DeltaError("missing", f"{chain.store.uri} holds no version")
        version = latest.version
    tried: list[list[ObjectRef]] = []
    while True:  # an object found damaged or missing: plan again around it, while another route exists
        plan = chain.plan(None, version)
        try:
            return _rebuild(chain, plan, base, progress)
        except DeltaError as e:
            if e.reason not in ("missing", "corrupt") or plan in tried:
                raise
            tried.append(plan)


def _rebuild(chain: Chain, plan: list[ObjectRef], base, progress: bool) -> tuple[dict[str, torch.Tensor], Header]:
    from tqdm.auto import tqdm

    from .apply import apply_delta
    from .checkpoint import load_state
    from .digest import state_digest

    state: dict[str, torch.Tensor] = {}
    header: Header | None = None
    for ref in tqdm(plan, desc="rebuild", unit="obj", disable=not progress):
        if ref.kind == "anchor":
            m = chain.manifest(ref.version)
            if ref.key is None:
                state, where = _external_state(ref, base, load_state)
                if state_digest(state) != m.state_digest:
                    raise DeltaError("wrong_base", f"{where} is not the chain's v{ref.version} "
                                     f"(the external checkpoint {ref.external!r})")
                header = Header(kind="anchor", version=ref.version, commitment=m.commitment,
                                base_commitment=m.base_commitment, state_digest=m.state_digest,
                                state_fingerprint=m.state_fingerprint, tensors={})
            else:
                with tempfile.TemporaryDirectory(prefix="deltasync-anchor-") as tmp:
                    f = DeltaFile.open(chain.download(ref, Path(tmp) / "anchor.safetensors"))
                    state, header = f.state(), f.header
        else:
            f = chain.fetch(ref)
            header = apply_delta(f, state, version=header.version, commitment=header.commitment)
    assert header is not None
    return state, header


def _external_state(ref: ObjectRef, base, load_state) -> tuple[dict[str, torch.Tensor], str]:
    """The state of an external genesis anchor: from ``base``, else from a local ``external``."""
    if isinstance(base, Mapping):  # copied: deltas are applied to it in place
        return {n: t.detach().clone() for n, t in base.items()}, "the given base state"
    where = base if base is not None else ref.external
    if where is None or not Path(where).exists():
        what = f"the external checkpoint {ref.external!r}"
        if base is not None:
            raise DeltaError("missing", f"v{ref.version} is {what}; no checkpoint at the given base {str(base)!r}")
        raise DeltaError("missing", f"v{ref.version} is {what}, not in the store and not a local path: "
                                    "download it and pass reconstruct(..., base=<its local folder>)")
    return load_state(where), str(where)
