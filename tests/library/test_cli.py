"""The ``deltasync`` CLI end to end, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from shared.checkpoint import load_state, save_state
from shared.digest import state_digest
from shared.fingerprint import state_fingerprint_of

from .cli_process import run_cli
from .helpers import perturb



def run(*args, ok=True):
    p = run_cli(args)
    assert (p.returncode == 0) == ok, p.stdout + p.stderr
    return p


def test_diff_apply_inspect_digest(tiny_model_dir, tmp_path):
    base = tiny_model_dir / "model.safetensors"
    s0 = load_state(base)
    s1 = perturb(s0, 0.01, 1)
    save_state(s1, tmp_path / "new.safetensors")
    run("diff", base, tmp_path / "new.safetensors", "-o", tmp_path / "d.safetensors")
    run("apply", base, tmp_path / "d.safetensors", "-o", tmp_path / "out.safetensors")
    assert run("digest", tmp_path / "out.safetensors").stdout.strip() == state_digest(s1)
    assert run("digest", tiny_model_dir).stdout.strip() == state_digest(s0)  # a model folder
    info = json.loads(run("inspect", tmp_path / "d.safetensors", "--json").stdout)
    assert info["kind"] == "delta" and info["version"] == 1 and info["state_digest"] == state_digest(s1)
    assert info["format_version"] == 4 and info["state_fingerprint"] == state_fingerprint_of(s1)
    text = run("inspect", tmp_path / "d.safetensors").stdout
    assert "model.embed_tokens.weight" in text and f"fingerprint {state_fingerprint_of(s1)}" in text
    # the output is itself a base for the next delta
    s2 = perturb(s1, 0.01, 2)
    save_state(s2, tmp_path / "new2.safetensors")
    run("diff", tmp_path / "out.safetensors", tmp_path / "new2.safetensors", "-o", tmp_path / "d2.safetensors")
    run("apply", tmp_path / "out.safetensors", tmp_path / "d2.safetensors", "-o", tmp_path / "out2.safetensors")
    assert run("digest", tmp_path / "out2.safetensors").stdout.strip() == state_digest(s2)


def test_apply_refuses_and_writes_nothing(tiny_model_dir, tmp_path):
    base = tiny_model_dir / "model.safetensors"
    s1 = perturb(load_state(base), 0.01, 1)
    save_state(s1, tmp_path / "new.safetensors")
    run("diff", base, tmp_path / "new.safetensors", "-o", tmp_path / "d.safetensors")
    # wrong base: the new checkpoint itself
    p = run("apply", tmp_path / "new.safetensors", tmp_path / "d.safetensors", "-o", tmp_path / "x", ok=False)
    assert "wrong_base" in p.stderr and not (tmp_path / "x").exists()
    # damaged delta
    raw = bytearray((tmp_path / "d.safetensors").read_bytes())
    raw[-10] ^= 0x40
    (tmp_path / "bad.safetensors").write_bytes(bytes(raw))
    p = run("apply", base, tmp_path / "bad.safetensors", "-o", tmp_path / "y", ok=False)
    assert "corrupt" in p.stderr and not (tmp_path / "y").exists()


def test_trl_prototype_format_imports(tiny_model_dir, tmp_path):
    import safetensors.torch

    base = tiny_model_dir / "model.safetensors"
    s0 = load_state(base)
    s1 = perturb(s0, 0.01, 5)
    tensors = {}
    for name in s0:
        a, b = s0[name].reshape(-1), s1[name].reshape(-1)
        idx = torch.nonzero(a.view(torch.int16) != b.view(torch.int16)).reshape(-1)
        tensors[f"{name}.indices"] = idx.to(torch.int32)
        tensors[f"{name}.values"] = b[idx].contiguous()
    safetensors.torch.save_file(tensors, tmp_path / "trl.safetensors",
                                metadata={"sparse": "true", "changed_params": str(len(s0))})
    run("apply", base, tmp_path / "trl.safetensors", "-o", tmp_path / "out.safetensors")
    assert state_digest(load_state(tmp_path / "out.safetensors")) == state_digest(s1)


def test_push_pull_log(tiny_model_dir, tmp_path):
    store = tmp_path / "store"
    base = tiny_model_dir / "model.safetensors"
    states = [load_state(base)]
    run("push", store, base)
    for i in range(3):
        states.append(perturb(states[-1], 0.01, 10 + i))
        save_state(states[-1], tmp_path / f"c{i}.safetensors")
        run("push", store, tmp_path / f"c{i}.safetensors")
    log = json.loads(run("log", store, "--json").stdout)
    assert [m["version"] for m in log] == [0, 1, 2, 3]
    assert "latest v3" in run("log", store).stdout
    for v in (1, 3):
        run("pull", store, "-o", tmp_path / f"p{v}.safetensors", "--version", v)
        assert state_digest(load_state(tmp_path / f"p{v}.safetensors")) == state_digest(states[v])
    p = run("push", store, tmp_path / "p1.safetensors")  # going back is just another version
    assert "v4" in p.stdout
    # a squashed delta 1 -> 4 is smaller than the three it replaces (v4 undoes v2 and v3)
    p = run("squash", store, "--from", 1, "--to", 4)
    assert "deltas/v00000001-v00000004.safetensors" in p.stdout
    from shared.chain import Chain
    from shared.stores import open_store

    chain = Chain(open_store(store))
    assert [(o.base_version, o.version) for o in chain.plan(1, 4)] == [(1, 4)]
    run("pull", store, "-o", tmp_path / "p4.safetensors")
    assert state_digest(load_state(tmp_path / "p4.safetensors")) == state_digest(states[1])


def test_push_with_digests_only_at_anchors(tiny_model_dir, tmp_path):
    """``push --digests anchors``: the delta's manifest names the state fingerprint alone (what
    ``digest --json`` prints for the checkpoint), and the version pulls back bit for bit."""
    from shared.chain import Chain
    from shared.stores import open_store

    store = tmp_path / "store"
    base = tiny_model_dir / "model.safetensors"
    new = perturb(load_state(base), 0.01, 7)
    save_state(new, tmp_path / "c.safetensors")
    run("push", store, base)
    assert "--digests" in run("push", store, tmp_path / "c.safetensors", "--digests", "some", ok=False).stderr
    run("push", store, tmp_path / "c.safetensors", "--digests", "anchors")
    m = Chain(open_store(store)).manifest(1)
    info = json.loads(run("digest", tmp_path / "c.safetensors", "--json").stdout)
    assert m.state_digest == "" and m.state_fingerprint == info["state_fingerprint"] == state_fingerprint_of(new)
    pulled = json.loads(run("pull", store, "-o", tmp_path / "p.safetensors", "--json").stdout)
    assert pulled["state_digest"] == info["state_digest"] == state_digest(load_state(tmp_path / "p.safetensors"))
    assert "v1" in run("log", store).stdout


def test_sharded_checkpoint_folder(tiny_model_dir, tmp_path):
    """A model folder with an index and several shards reads as one checkpoint."""
    state = load_state(tiny_model_dir)
    names = sorted(state)
    folder = tmp_path / "sharded"
    folder.mkdir()
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_state({k: state[k] for k in keys}, folder / shard)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: s for s, keys in shards.items() for k in keys}}))
    assert run("digest", folder).stdout.strip() == state_digest(state)
    new = perturb(state, 0.01, 7)
    save_state(new, tmp_path / "new.safetensors")
    run("diff", folder, tmp_path / "new.safetensors", "-o", tmp_path / "d.safetensors")
    run("apply", folder, tmp_path / "d.safetensors", "-o", tmp_path / "out.safetensors")
    assert state_digest(load_state(tmp_path / "out.safetensors")) == state_digest(new)


def test_warmup_runs_a_trainer_and_a_replica(tmp_path):
    """``deltasync warmup`` (an image's last build step) runs both parts into NUMBA_CACHE_DIR and
    says where that is. In a process of its own, as in an image build: run from the test zygote (a
    fork of a process that has run torch's and blake3's thread pools) it hung."""
    cache = tmp_path / "numba"
    p = subprocess.run([sys.executable, "-m", "shared.cli", "warmup"], capture_output=True, text=True,
                       env={**os.environ, "NUMBA_CACHE_DIR": str(cache)}, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("kernels compiled or loaded in ") and "publish " in p.stdout and "apply " in p.stdout
    assert p.stdout.rstrip().endswith(f"cache: {cache}")
    assert any(cache.rglob("*.nbi"))  # numba's index files: the kernels are in the cache
