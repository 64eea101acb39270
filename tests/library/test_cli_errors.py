"""Issue 12, "Errors a user can read" and "Output and help": each case is the exact command a user
types. A mistake ends in one line on stderr ("error: ..." and what to do), exit status 1 (2 for a
bad command line), no traceback, and nothing written or changed; output a script reads is
unwrapped, free of progress bars, and JSON on request; --help says what a user needs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shared.checkpoint import load_state, save_state
from shared.digest import state_digest

from .cli_process import isolated_env as _env
from .cli_process import run_cli

ROOT = Path(__file__).resolve().parents[2]
LONG = "model.layers.0.mlp." + "very_long_module_name_" * 5 + "weight"  # > 80 columns on its own


def deltasync(cwd: Path, *args, **env: str) -> subprocess.CompletedProcess:
    return run_cli(args, cwd=cwd, env=_env(**env))


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file's bytes and every folder under root."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def refused(p: subprocess.CompletedProcess, *needles: str, code: int = 1) -> str:
    """Exit status ``code``, no traceback, nothing on stdout; status 1 is exactly one line."""
    assert p.returncode == code, p.stdout + p.stderr
    assert "Traceback" not in p.stderr and p.stdout == "", p.stdout + p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    if code == 1:
        assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    for needle in needles:
        assert needle in p.stderr, p.stderr
    return p.stderr


def unchanged(cwd: Path, *args, needles=(), code: int = 1, **env: str) -> str:
    """Run, expect a refusal, and check that nothing under cwd was written or changed."""
    before = snapshot(cwd)
    message = refused(deltasync(cwd, *args, **env), *needles, code=code)
    assert snapshot(cwd) == before, f"{args} wrote or changed something"
    return message


# --------------------------------------------------------------------------- a workspace


def _states():
    g = torch.Generator().manual_seed(0)
    base = {"a": torch.randn(64, 32, generator=g).bfloat16(), "b": torch.randn(128, generator=g).bfloat16(),
            LONG: torch.randn(16, generator=g).bfloat16()}
    steps = [base]
    for i in range(3):
        s = {n: t.clone() for n, t in steps[-1].items()}
        s["a"][i, :5] += 1
        steps.append(s)
    return steps


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """Checkpoints of every kind a user may pass, and a store holding v0..v3."""
    from shared.publisher import DeltaPublisher

    root = tmp_path_factory.mktemp("workspace")
    steps = _states()
    save_state(steps[0], root / "base.safetensors")
    save_state(steps[3], root / "v3.safetensors")
    new = {n: t.clone() for n, t in steps[3].items()}
    new["b"][:7] += 1
    save_state(new, root / "new.safetensors")
    save_state({n: t.float() for n, t in new.items()}, root / "new-fp32.safetensors")
    save_state({**steps[0], "a": steps[0]["a"].half()}, root / "fp16.safetensors")
    save_state({**new, "a": new["a"].reshape(32, 64).clone()}, root / "reshaped.safetensors")
    (root / "notes.txt").write_text("not a checkpoint\n")
    (root / "huge-header.safetensors").write_bytes((1 << 60).to_bytes(8, "little") + b"{}")
    shards = root / "shards-no-index"
    shards.mkdir()
    save_state({"a": steps[0]["a"]}, shards / "model-00001-of-00002.safetensors")
    save_state({"b": steps[0]["b"]}, shards / "model-00002-of-00002.safetensors")
    dup = root / "shards-duplicate"
    dup.mkdir()
    save_state({"a": steps[0]["a"], "b": steps[0]["b"]}, dup / "model-00001-of-00002.safetensors")
    save_state({"b": steps[1]["b"]}, dup / "model-00002-of-00002.safetensors")
    (dup / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    state = {n: t.clone() for n, t in steps[0].items()}
    with DeltaPublisher(state, str(root / "store"), keep_anchors=100) as pub:
        for s in steps[1:]:
            for n in state:
                state[n].copy_(s[n])
            pub.publish()
    (root / "store" / "writer.lock").unlink(missing_ok=True)
    return root


@pytest.fixture
def work(template, tmp_path) -> Path:
    shutil.copytree(template, tmp_path / "w")
    return tmp_path / "w"


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("args", [
    ("diff", "notes.txt", "new.safetensors", "-o", "d.safetensors"),
    ("digest", "notes.txt"),
    ("push", "store", "notes.txt"),
    ("apply", "base.safetensors", "notes.txt", "-o", "out.safetensors"),
    ("inspect", "notes.txt"),
    ("inspect", "huge-header.safetensors"),  # was a MemoryError: the header length was trusted
    ("apply", "base.safetensors", "huge-header.safetensors", "-o", "out.safetensors"),
    ("digest", "huge-header.safetensors"),
], ids=lambda a: "-".join(a[:2]))
def test_not_a_safetensors_file(work, args):
    unchanged(work, *args, needles=("not a safetensors file",))


def test_store_uris_that_cannot_be_opened(work):
    unchanged(work, "log", "foo://bucket/run", needles=("unknown store scheme foo://", "hf://buckets/"))
    unchanged(work, "log", "gs://bucket/run", needles=("pip install gcsfs",))
    for cmd in (("log", "s3://bucket/run"), ("push", "s3://bucket/run", "base.safetensors"),
                ("pull", "s3://bucket/run", "-o", "out.safetensors")):
        unchanged(work, *cmd, needles=("no usable credentials", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"))
    # hf:// with the Hub unreachable (HF_ENDPOINT points at a closed port), and offline mode
    for cmd in (("log", "hf://buckets/me/deltas/run"), ("push", "hf://buckets/me/deltas/run", "base.safetensors")):
        unchanged(work, *cmd, needles=("cannot reach the Hugging Face Hub", "HF_ENDPOINT"))
    unchanged(work, "log", "hf://buckets/me/deltas/run", needles=("offline mode",), HF_HUB_OFFLINE="1")
    unchanged(work, "log", "hf://meta-llama/Llama-3", needles=("must be Storage Buckets",))


def test_read_only_commands_create_nothing(work):
    for cmd in (("log", "stroe"), ("pull", "stroe", "-o", "out.safetensors"), ("squash", "stroe", "--from", "0")):
        unchanged(work, *cmd, needles=("no store at stroe", "no such folder"))
    assert not (work / "stroe").exists()


def test_squash_on_an_empty_store(work):
    (work / "empty").mkdir()
    unchanged(work, "squash", "empty", "--from", "0", needles=("missing: empty holds no version yet",))


def test_push_of_other_shapes_or_dtypes(work):
    unchanged(work, "push", "store", "reshaped.safetensors",
              needles=("shape_mismatch: a has shape (64, 32) in v3, (32, 64) in reshaped.safetensors",))


def test_output_into_a_missing_folder(work):
    for cmd in (("diff", "base.safetensors", "new.safetensors"), ("pull", "store"),
                ("apply", "base.safetensors", "new.safetensors")):
        unchanged(work, *cmd, "-o", "nodir/out.safetensors",
                  needles=("-o nodir/out.safetensors: the folder nodir does not exist",))
        unchanged(work, *cmd, "-o", "store", needles=("is a folder",))


def test_dtype_is_named(work):
    # an fp32 copy as the base of a bf16 delta: a dtype mismatch, not "wrong_base"
    assert deltasync(work, "diff", "v3.safetensors", "new.safetensors", "-o", "d.safetensors").returncode == 0
    save_state({n: t.float() for n, t in load_state(work / "v3.safetensors").items()}, work / "v3-fp32.safetensors")
    message = unchanged(work, "apply", "v3-fp32.safetensors", "d.safetensors", "-o", "out.safetensors",
                        needles=("shape_mismatch", "has dtype float32 in BASE, bfloat16 in the delta"))
    assert "wrong_base" not in message
    unchanged(work, "diff", "base.safetensors", "fp16.safetensors", "-o", "d2.safetensors",
              needles=("shape_mismatch: a has dtype bfloat16 in BASE, float16 in NEW",))


def test_push_says_it_casts_fp32(work):
    p = deltasync(work, "push", "store", "new-fp32.safetensors")
    assert p.returncode == 0, p.stderr
    assert p.stderr.startswith("note: new-fp32.safetensors: 3 of 3 tensors are float32; they are published "
                               "as bfloat16") and len(p.stderr.splitlines()) == 1
    assert p.stdout.startswith("v4 (")
    assert deltasync(work, "pull", "store", "-o", "v4.safetensors").returncode == 0
    assert state_digest(load_state(work / "v4.safetensors")) == state_digest(load_state(work / "new.safetensors"))


def test_version_options(work):
    unchanged(work, "pull", "store", "-o", "out.safetensors", "--version", "-1",
              needles=("Invalid value for '--version'",), code=2)
    unchanged(work, "pull", "store", "-o", "out.safetensors", "--version", "9",
              needles=("missing: store has no v9: the latest is v3",))
    unchanged(work, "squash", "store", "--from", "3", "--to", "3", needles=("3 must be below --to 3",), code=2)
    unchanged(work, "squash", "store", "--from", "3", needles=("3 must be below the latest version, v3",), code=2)
    unchanged(work, "squash", "store", "--from", "2", "--to", "3", needles=("one step",), code=2)
    unchanged(work, "diff", "base.safetensors", "new.safetensors", "-o", "d.safetensors", "--version", "0",
              needles=("Invalid value for '--version'",), code=2)
    # --version is honoured, and must be above the base's: a pulled anchor is v3
    assert deltasync(work, "pull", "store", "-o", "p3.safetensors").returncode == 0
    unchanged(work, "diff", "p3.safetensors", "new.safetensors", "-o", "d.safetensors", "--version", "3",
              needles=("3 must be above BASE's version, v3",), code=2)
    assert deltasync(work, "diff", "p3.safetensors", "new.safetensors", "-o", "d.safetensors", "--version",
                     "7").returncode == 0
    info = json.loads(deltasync(work, "inspect", "d.safetensors", "--json").stdout)
    assert (info["base_version"], info["version"]) == (3, 7)


def test_sharded_folders_are_never_guessed(work):
    unchanged(work, "digest", "shards-no-index",
              needles=("2 .safetensors files", "no model.safetensors.index.json"))
    unchanged(work, "push", "store", "shards-duplicate",
              needles=("tensor 'b' is in both model-00001-of-00002.safetensors and model-00002-of-00002",))


def test_identical_inputs(work):
    p = deltasync(work, "diff", "base.safetensors", "base.safetensors", "-o", "same.safetensors")
    assert p.returncode == 0 and "no element changed" in p.stdout and "B/changed" not in p.stdout, p.stdout
    unchanged(work, "push", "store", "v3.safetensors",
              needles=("v3.safetensors equals v3, the latest in store", "--allow-empty"))
    p = deltasync(work, "push", "store", "v3.safetensors", "--allow-empty")
    assert p.returncode == 0 and p.stdout.startswith("v4 (") and "no element changed" in p.stdout, p.stdout


def test_unexpected_errors_are_one_line_too(work):
    """The safety net for a bug: one line and how to see the traceback."""
    code = "import sys, shared.cli as c; c.load_state = lambda p: 1 / 0; sys.argv[0] = 'deltasync'; c.app()"
    args = [sys.executable, "-c", code, "digest", "base.safetensors"]
    p = subprocess.run(args, cwd=work, capture_output=True, text=True, env=_env(), timeout=120)
    refused(p, "ZeroDivisionError: division by zero", "DELTASYNC_DEBUG=1")
    p = subprocess.run(args, cwd=work, capture_output=True, text=True, env=_env(DELTASYNC_DEBUG="1"), timeout=120)
    assert p.returncode == 1 and "Traceback" in p.stderr


# --------------------------------------------------------------------------- output


def test_piped_output_is_whole_lines_without_progress_bars(work):
    out = "a-delta-file-with-a-name-long-enough-to-push-this-line-well-past-eighty-columns.safetensors"
    p = deltasync(work, "diff", "v3.safetensors", "new.safetensors", "-o", out)
    assert p.returncode == 0 and p.stderr == "", p.stderr  # no progress bar into a pipe
    assert len(p.stdout.splitlines()) == 1 and "7 of 2,192 elements changed" in p.stdout
    p = deltasync(work, "inspect", out)
    assert any(LONG in line for line in p.stdout.splitlines()), p.stdout  # the table is not cut to 80
    p = deltasync(work, "pull", "store", "-o", "p.safetensors", "--version", "1")
    assert p.returncode == 0 and p.stderr == "" and len(p.stdout.splitlines()) == 1
    p = deltasync(work, "log", "store")
    assert "store (latest v3)" in p.stdout and all(f"│ {v} " in p.stdout for v in range(4))


def test_json_outputs(work):
    def as_json(*args):
        p = deltasync(work, *args, "--json")
        assert p.returncode == 0 and p.stderr == "", p.stderr
        return json.loads(p.stdout)

    assert [m["version"] for m in as_json("log", "store")] == [0, 1, 2, 3]
    d = as_json("diff", "v3.safetensors", "new.safetensors", "-o", "d.safetensors")
    assert (d["base_version"], d["version"], d["changed"], d["file_bytes"]) == (
        0, 1, 7, (work / "d.safetensors").stat().st_size)
    assert as_json("inspect", "d.safetensors")["state_digest"] == d["state_digest"]
    assert as_json("digest", "new.safetensors")["state_digest"] == d["state_digest"]
    r = as_json("push", "store", "new.safetensors")
    assert (r["version"], r["changed"], r["state_digest"]) == (4, 7, d["state_digest"])
    pulled = as_json("pull", "store", "-o", "p.safetensors", "--version", "4")
    assert (pulled["version"], pulled["state_digest"]) == (4, d["state_digest"])
    assert as_json("apply", "v3.safetensors", "d.safetensors", "-o", "a.safetensors")["state_digest"] == \
        d["state_digest"]


# --------------------------------------------------------------------------- help


def test_deltasync_help(work):
    p = deltasync(work, "--help")
    assert p.returncode == 0
    text = p.stdout
    for needle in ("Examples:", "deltasync push ./store", "hf://buckets/NAMESPACE/NAME", "HF_TOKEN",
                   "s3://BUCKET", "AWS_ACCESS_KEY_ID", "DELTASYNC_DEBUG=1"):
        assert needle in text, needle
    for markup in ("``", "[bold", "[/]", "╭", "│"):
        assert markup not in text, markup
    push = deltasync(work, "push", "--help").stdout
    assert "--allow-empty" in push and "--json" in push and "bfloat16" in push


def test_rollout_and_env_help():
    """``python -m rollout_space --help`` leads with our flags (vLLM's behind --help=all);
    without a store it refuses to start; ``python -m env_space --help`` states every default."""
    env = _env()
    rollout = [sys.executable, "-m", "rollout_space"]
    procs = [subprocess.Popen([*rollout, "--help"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True),
             subprocess.Popen([*rollout, "--model", "some-model"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)]
    (help_out, _), (_, no_store_err) = (p.communicate(timeout=300) for p in procs)
    assert [p.returncode for p in procs] == [0, 2]
    assert "--store is required (or set DELTASYNC_STORE)" in no_store_err and "Traceback" not in no_store_err
    lines = help_out.splitlines()
    assert len(lines) < 100, "vLLM's engine flags belong behind --help=all"
    ours = ["--store", "--token", "--insecure-no-token", "--max-body-bytes", "--map-cache", "--work-dir",
            "--poll-s", "--no-predict"]
    first = [next(i for i, ln in enumerate(lines) if ln.strip().startswith(flag)) for flag in ours]
    assert first == sorted(first) and first[0] < lines.index("server options (vLLM's):")
    for needle in ("(default: 16777216", "(default: 10.0)", "neither is set here", "DELTASYNC_TOKEN",
                   "--help=all", "every interface, 0.0.0.0", "--port PORT", "(default: 8000)"):
        assert needle in " ".join(help_out.split()), needle  # help wraps at the terminal's width
    assert "./bucket" not in help_out

    p = subprocess.run([sys.executable, "-m", "env_space", "--help"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0
    blocks = p.stdout.split("options:")[1]
    for flag, default in (("--host", "0.0.0.0"), ("--port", "7860"), ("--max-sessions", "256"),
                          ("--session-timeout", "300.0"), ("--max-body-bytes", "65536"),
                          ("--max-invalid-moves", "20"), ("--no-web", "mounted"), ("--log-level", "info")):
        block = blocks.split(f"  {flag}", 1)[1].split("\n  --", 1)[0]
        assert f"(default: {default})" in " ".join(block.split()), (flag, block)
