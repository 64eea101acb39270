"""Issue 9 (library side): flat-buffer parameters, tied checkpoints, manifest keys, external bases."""

from __future__ import annotations

import json
import shutil

import pytest
import safetensors.torch
import torch

from shared.chain import AnchorPolicy, Chain, ObjectRef, manifest_key, reconstruct
from shared import checkpoint
from shared.checkpoint import load_state, module_state, save_state
from shared.digest import state_digest
from shared.errors import DeltaError
from shared.publisher import DeltaPublisher
from shared.stores import open_store

from .helpers import perturb, same_bits


# ------------------------------------------------------------------ 1: flat buffers, tied weights


class FlatModule(torch.nn.Module):
    """Parameters that are views of one flat buffer, as FSDP flat params, ZeRO or Megatron's
    distributed optimizer lay them out: one untyped storage, several offsets."""

    SHAPES = {"a": (8, 4), "b": (4,), "c": (3, 5), "d": (2, 2)}

    def __init__(self, dtype=torch.bfloat16):
        super().__init__()
        total = sum(torch.Size(s).numel() for s in self.SHAPES.values())
        torch.manual_seed(0)
        self.flat = (torch.randn(total) * 0.02).to(dtype)
        offset = 0
        for name, shape in self.SHAPES.items():
            n = torch.Size(shape).numel()
            view = self.flat[offset:offset + n].view(shape)
            setattr(self, name, torch.nn.Parameter(view, requires_grad=False))
            offset += n


class TiedModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.embed = torch.nn.Embedding(16, 4, dtype=torch.bfloat16)
        self.proj = torch.nn.Linear(4, 4, bias=False, dtype=torch.bfloat16)
        self.lm_head = torch.nn.Linear(4, 16, bias=False, dtype=torch.bfloat16)
        self.lm_head.weight = self.embed.weight  # tied: the same parameter


def test_module_state_keeps_every_view_of_a_flat_buffer():
    m = FlatModule()
    state = module_state(m)
    assert set(state) == {"a", "b", "c", "d"}
    for name in FlatModule.SHAPES:
        assert state[name].data_ptr() == getattr(m, name).data_ptr()  # live, no copy


def test_module_state_sends_a_tied_weight_once():
    m = TiedModule()
    assert set(module_state(m)) == {"embed.weight", "proj.weight"}


def test_flat_buffer_module_publishes_and_rebuilds_exactly(tmp_path):
    m = FlatModule()
    states = [{n: t.clone() for n, t in module_state(m).items()}]
    with DeltaPublisher(m, str(tmp_path), keep_anchors=100) as pub:
        for step in range(3):
            new = perturb({"flat": m.flat}, 0.2, step + 1)["flat"]
            m.flat.copy_(new)  # the optimizer steps the flat buffer
            pub.publish()
            states.append({n: t.clone() for n, t in module_state(m).items()})
    chain = Chain(open_store(tmp_path))
    for v, want in enumerate(states):
        state, header = reconstruct(chain, v)
        assert set(state) == {"a", "b", "c", "d"}
        assert same_bits(state, want)
        assert header.state_digest == state_digest(want)
    assert pub.reports[-1].changed > 0


# ------------------------------------------------------------------ 5: tied checkpoint that saves lm_head


def _tied_checkpoint_with_lm_head(tiny_model_dir, out):
    """The tiny tied model, re-saved with ``lm_head.weight`` stored as well (as some exporters do)."""
    shutil.copytree(tiny_model_dir, out)
    state = load_state(tiny_model_dir / "model.safetensors")
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_state(state, out / "model.safetensors")
    return out


def test_tied_checkpoint_state_agrees_with_the_trainer(tiny_model_dir, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    ckpt = _tied_checkpoint_with_lm_head(tiny_model_dir, tmp_path / "tied")
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        file_names = set(f.keys())
    assert "lm_head.weight" in file_names
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    assert model.config.tie_word_embeddings
    trainer = module_state(model)
    replica = load_state(ckpt)
    assert set(trainer) == set(replica) == file_names - {"lm_head.weight"}
    assert state_digest(trainer) == state_digest(replica)
    # the rule the rollout worker applies to the file headers, before any tensor is loaded
    assert checkpoint.tied_aliases(ckpt) == ["lm_head.weight"]
    assert file_names - set(checkpoint.tied_aliases(ckpt)) == set(trainer)
    assert checkpoint.tied_aliases(tiny_model_dir) == []  # nothing stored twice: nothing dropped


def test_a_stored_lm_head_is_kept_unless_it_is_an_exact_tied_alias(tiny_model_dir, tmp_path):
    # declared tied but different bits: not an alias, kept (the digests then refuse, loudly)
    ckpt = _tied_checkpoint_with_lm_head(tiny_model_dir, tmp_path / "differs")
    state = safetensors.torch.load_file(str(ckpt / "model.safetensors"))  # every stored tensor
    state["lm_head.weight"] = perturb({"w": state["lm_head.weight"]}, 0.01, 3)["w"]
    save_state(state, ckpt / "model.safetensors")
    assert checkpoint.tied_aliases(ckpt) == [] and "lm_head.weight" in load_state(ckpt)
    # the same bits in an untied model are two tensors, both kept
    untied = _tied_checkpoint_with_lm_head(tiny_model_dir, tmp_path / "untied")
    cfg = json.loads((untied / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    assert checkpoint.tied_aliases(untied) == [] and "lm_head.weight" in load_state(untied)


# ------------------------------------------------------------------ 8a: manifest keys


def _publish(store_dir, versions=2):
    torch.manual_seed(0)
    state = {"w": (torch.randn(64, 32) * 0.02).bfloat16()}
    with DeltaPublisher(state, str(store_dir), policy=AnchorPolicy(max_deltas=1), keep_anchors=100) as pub:
        for i in range(versions):
            state["w"].copy_(perturb(state, 0.05, i + 1)["w"])
            pub.publish()
    return state


@pytest.mark.parametrize("key", ["../victim.txt", "anchors/../../victim.txt", "{victim}",
                                 "manifests/v00000000.json", "latest.json", "anchors/", "deltas\\..\\x"])
def test_object_ref_refuses_keys_outside_anchors_and_deltas(key):
    with pytest.raises(ValueError):
        ObjectRef(kind="anchor", version=0, key=key.format(victim="/tmp/victim.txt"))


def test_object_ref_accepts_the_chain_layout():
    for key in ("anchors/v00000012.safetensors", "deltas/v00000013.safetensors",
                "deltas/v00000010-v00000013.safetensors"):
        assert ObjectRef(kind="delta", version=13, base_version=12, key=key).key == key
    assert ObjectRef(kind="anchor", version=0, external="org/model").key is None


@pytest.mark.parametrize("evil", ["../victim.txt", "anchors/../../victim.txt", "{abs}"])
def test_a_manifest_pointing_outside_the_store_is_refused(tmp_path, evil):
    store_dir = tmp_path / "store"
    _publish(store_dir, versions=3)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    key = evil.format(abs=str(victim))
    raw = json.loads((store_dir / manifest_key(0)).read_text())
    raw["objects"][0]["key"] = key
    (store_dir / manifest_key(0)).write_text(json.dumps(raw))
    chain = Chain(open_store(store_dir))  # every version is anchored: keeping one drops v0
    with pytest.raises(DeltaError) as e:
        chain.retain(keep_anchors=1)
    assert e.value.reason == "format"
    with pytest.raises(DeltaError) as e:
        reconstruct(Chain(open_store(store_dir)), 0)
    assert e.value.reason == "format"
    assert victim.read_text() == "keep me"
    assert (store_dir / manifest_key(0)).exists()


# ------------------------------------------------------------------ 8b: external base


def test_reconstruct_from_an_external_base(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    base = _tied_checkpoint_with_lm_head(tiny_model_dir, tmp_path / "base")  # stores lm_head too
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    store = tmp_path / "store"
    want = []
    with DeltaPublisher(model, str(store), external_base="org/tiny-model", keep_anchors=100) as pub:
        want.append({n: t.clone() for n, t in module_state(model).items()})
        for step in range(2):
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(perturb({"p": p.data}, 0.02, 10 + step)["p"])
            pub.publish()
            want.append({n: t.clone() for n, t in module_state(model).items()})
    chain = Chain(open_store(store))
    assert chain.manifest(0).object("anchor").external == "org/tiny-model"
    with pytest.raises(DeltaError) as e:  # a Hub id is not a local checkpoint
        reconstruct(chain, 2)
    assert e.value.reason == "missing" and "base=" in e.value.message
    for v in range(3):
        state, header = reconstruct(chain, v, base=base)  # a local copy, tied lm_head and all
        assert same_bits(state, want[v]) and header.state_digest == chain.manifest(v).state_digest
    state, _ = reconstruct(chain, 2, base=load_state(base))  # or its state
    assert same_bits(state, want[2])
    with pytest.raises(DeltaError) as e:
        reconstruct(chain, 2, base=tiny_model_dir / "nope")
    assert e.value.reason == "missing"
    wrong = {n: t.clone() for n, t in want[1].items()}
    with pytest.raises(DeltaError) as e:
        reconstruct(chain, 2, base=wrong)
    assert e.value.reason == "wrong_base"
