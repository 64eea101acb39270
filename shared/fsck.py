"""Check a store's version chain end to end, and repair it back to its newest restorable version.

A chain can be left inconsistent by what the publish protocol cannot prevent on a
non-transactional store: a writer that died between its manifest and ``latest.json``, objects
damaged or deleted by hand, or (before the writer lock) two writers interleaving. ``check``
verifies every object against its manifest (size, blake3, the commitments in its header) and
works out which versions can still be rebuilt; ``repair`` moves ``latest`` to the newest of those
at or below it, then removes what no reader may follow: manifests past it, unreadable or
unreachable, refs to damaged objects, objects no manifest names and leftover temporary uploads.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .chain import LATEST, Chain, Latest, Manifest, ObjectRef, manifest_key
from .codec import read_header
from .errors import DeltaError
from .lock import Holder, WriterLock, read_holder
from .stores import Store

OBJECT_FOLDERS = ("anchors", "deltas")


@dataclass
class Finding:
    what: str
    version: int | None = None
    key: str | None = None


@dataclass
class FsckReport:
    store: str
    latest: int | None
    versions: list[int]  # versions with a readable manifest
    restorable: list[int]  # versions whose state the checked objects rebuild
    unreadable: list[int] = field(default_factory=list)  # versions whose manifest does not parse
    problems: list[Finding] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)  # objects no manifest names, temporary leftovers
    writer: Holder | None = None
    repaired: list[str] = field(default_factory=list)
    bad_refs: dict[int, list[str]] = field(default_factory=dict, repr=False)  # version -> keys failing checks

    @property
    def ok(self) -> bool:
        return not self.problems and not self.orphans

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("bad_refs")
        return d | {"ok": self.ok, "writer": self.writer.model_dump() if self.writer else None}


def _check_ref(chain: Chain, m: Manifest, ref: ObjectRef, manifests: dict[int, Manifest], tmp: Path) -> str | None:
    """Why ``ref`` cannot be used to reach ``m.version``, or None."""
    if ref.key is None:
        return None  # an external checkpoint: the replicas check its state digest themselves
    try:
        path = chain.download(ref, tmp / "object")
    except DeltaError as e:
        return e.message
    try:
        header = read_header(path)
    except DeltaError as e:
        return f"{ref.key}: {e.message}"
    finally:
        path.unlink(missing_ok=True)
    if header.commitment != m.commitment:
        return f"{ref.key} reaches commitment {header.commitment[:12]}, not v{m.version}'s {m.commitment[:12]}"
    if ref.kind == "delta":
        base = manifests.get(ref.base_version)  # type: ignore[arg-type]
        if base is not None and header.base_commitment != base.commitment:
            return f"{ref.key} starts from another v{ref.base_version} than the one in this store"
    return None


def check(store: Store) -> FsckReport:
    chain = Chain(store)
    problems: list[Finding] = []
    manifests: dict[int, Manifest] = {}
    unreadable: list[int] = []
    for v in chain.versions():
        try:
            manifests[v] = chain.manifest(v, refresh=True)
        except DeltaError as e:
            problems.append(Finding(f"manifest v{v} is unreadable: {e.message}", v, manifest_key(v)))
            unreadable.append(v)
    try:
        raw = store.get(LATEST)
        latest: Latest | None = Latest.model_validate_json(raw)
    except DeltaError:
        latest = None
        if manifests:
            problems.append(Finding("latest.json is missing", key=LATEST))
    except ValueError:
        latest = None
        problems.append(Finding("latest.json is unreadable", key=LATEST))

    restorable: set[int] = set()
    bad_refs: dict[int, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="deltasync-fsck-") as tmp:
        for v in sorted(manifests):
            m = manifests[v]
            for ref in m.objects:
                why = _check_ref(chain, m, ref, manifests, Path(tmp))
                if why:
                    problems.append(Finding(why, v, ref.key))
                    bad_refs.setdefault(v, []).append(ref.key or "")
                elif ref.kind == "anchor" or ref.base_version in restorable:
                    restorable.add(v)
            if v not in restorable and v not in bad_refs:
                problems.append(Finding(f"v{v} cannot be rebuilt: no anchor, and no delta from a restorable version", v))

    if latest is not None:
        m = manifests.get(latest.version)
        if m is None:
            problems.append(Finding(f"latest.json names v{latest.version}, which has no manifest", latest.version))
        elif m.commitment != latest.commitment:
            problems.append(Finding(f"latest.json's commitment is not v{latest.version}'s", latest.version, LATEST))
        elif latest.version not in restorable:
            problems.append(Finding(f"latest (v{latest.version}) cannot be rebuilt", latest.version))
        for v in sorted(manifests):
            if v > latest.version:
                problems.append(Finding(f"v{v} has a manifest but latest is v{latest.version} "
                                        "(an unfinished publish, or a second writer)", v, manifest_key(v)))

    named = {o.key for m in manifests.values() for o in m.objects if o.key}
    orphans = [k for folder in OBJECT_FOLDERS for k in store.list(folder, include_tmp=True) if k not in named]
    # a writer that died inside a put leaves its temporary copy: beside a manifest, latest.json or writer.lock
    orphans += [k for folder in ("manifests", "") for k in store.list(folder, include_tmp=True) if ".tmp-" in k]
    return FsckReport(store=store.uri, latest=latest.version if latest else None, versions=sorted(manifests),
                      restorable=sorted(restorable), unreadable=unreadable, problems=problems, orphans=orphans,
                      writer=read_holder(store), bad_refs=bad_refs)


def repair(store: Store) -> FsckReport:
    """Bring the chain back to its newest restorable version at or below ``latest``, as the
    store's only writer. Every removal is listed in the returned report's ``repaired``."""
    with WriterLock(store, "deltasync fsck --repair"):
        found = check(store)
        done: list[str] = []
        ceiling = found.latest if found.latest is not None else max(found.restorable, default=-1)
        below = [v for v in found.restorable if v <= ceiling]
        if not below:
            if found.versions or found.unreadable:
                raise DeltaError("missing", f"{store.uri}: no version at or below latest can be rebuilt; "
                                 "publish a new anchor into an empty store")
            return found
        target = max(below)
        for v in found.unreadable:
            store.delete(manifest_key(v))
            done.append(f"deleted unreadable manifest v{v}")
        chain = Chain(store)
        m = chain.manifest(target, refresh=True)
        if found.latest != target or any(f.key == LATEST for f in found.problems):
            store.put(LATEST, Latest(version=target, commitment=m.commitment).model_dump_json().encode())
            done.append(f"latest -> v{target}")
        for v in found.versions:
            if v > target or v not in found.restorable:
                store.delete(manifest_key(v))
                done.append(f"deleted manifest v{v}")
            elif v in found.bad_refs:
                kept = chain.manifest(v, refresh=True)
                kept.objects = [o for o in kept.objects if o.key not in found.bad_refs[v]]
                store.put(manifest_key(v), kept.model_dump_json(indent=1).encode())
                done.append(f"v{v}: dropped {', '.join(found.bad_refs[v])}")
        for key in check(store).orphans:  # objects only the removed manifests named, temporary leftovers
            store.delete(key)
            done.append(f"deleted {key}")
    result = check(store)
    result.repaired = done
    return result
