"""Probe maps and the staged apply on a small stand-in for a vLLM model (no engine, fast).

The stand-in loads checkpoint tensors the way vLLM's loaders do: q/k/v fused into one
parameter, a padded vocabulary whose padding rows are zero-filled on every load, a tied LM head
the loader skips, and one transposed weight (many runs instead of one).
"""

from __future__ import annotations

import pytest
import torch

from rollout_space.mapping import EngineMap, LiveMap, MapError, build_map
from rollout_space.live_weights import LiveWeights, check_shards, genesis_commitment
from rollout_space.server import policy_fields, policy_headers
from shared.codec import DeltaFile, encode_delta
from shared.digest import SAFETENSORS_DTYPES, state_digest, tensor_digest
from shared.errors import DeltaError
from shared.fingerprint import state_fingerprint_of, tensor_fingerprint

BF16 = torch.bfloat16
CKPT = {"embed.weight": (10, 4), "q.weight": (4, 4), "k.weight": (2, 4), "v.weight": (2, 4),
        "o.weight": (48, 40), "norm.weight": (4,), "lm_head.weight": (10, 4)}


class FusedModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.zeros(16, 4, dtype=BF16), requires_grad=False)
        self.qkv = torch.nn.Parameter(torch.zeros(8, 4, dtype=BF16), requires_grad=False)
        self.o_t = torch.nn.Parameter(torch.zeros(40, 48, dtype=BF16), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(4, dtype=BF16), requires_grad=False)
        self.lm_head = self.embed  # tied: the same parameter

    def load_weights(self, weights):
        rows = {"q.weight": 0, "k.weight": 4, "v.weight": 6}
        for name, t in weights:
            if name == "embed.weight":
                self.embed.data[:10].copy_(t)
                self.embed.data[10:].fill_(0)  # vLLM zero-fills the padding rows on every load
            elif name in rows:
                self.qkv.data[rows[name]: rows[name] + t.shape[0]].copy_(t)
            elif name == "o.weight":
                self.o_t.data.copy_(t.t())
            elif name == "norm.weight":
                self.norm.data.copy_(t)
            # lm_head.weight: tied, skipped like vLLM does


def checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(s, generator=g) * 0.02).to(BF16) for n, s in CKPT.items()}


def _load(model: FusedModel, key: str):
    ckpt = checkpoint()
    ckpt["lm_head.weight"] = ckpt["embed.weight"].clone()
    specs = {n: (SAFETENSORS_DTYPES[t.dtype], list(t.shape)) for n, t in ckpt.items()}
    emap = build_map(model, specs, key=key)
    emap = EngineMap.model_validate_json(emap.model_dump_json())  # the cache round trip
    model.load_weights(ckpt.items())
    live = LiveMap(emap, model)
    head = ckpt["lm_head.weight"]
    weights = LiveWeights(model, live, specs, {"lm_head.weight": tensor_digest(head)},
                          {"lm_head.weight": tensor_fingerprint(head).hex()}, audit_every=3)
    weights.read_back()
    return ckpt, model, emap, weights


@pytest.fixture
def loaded():
    return _load(FusedModel(), "test")


def test_probe_finds_fused_padded_tied_and_transposed_layouts(loaded):
    ckpt, model, emap, weights = loaded
    assert emap.ignored == ["lm_head.weight"]
    names = [p.name for p in emap.params]
    t = emap.tensors
    assert (t["k.weight"].param, t["k.weight"].param_start, t["k.weight"].length) == ([names.index("qkv")], [16], [8])
    assert (t["v.weight"].param_start, t["embed.weight"].param_start) == ([24], [0])
    assert len(t["o.weight"].hf_start) == 48 * 40  # transposed: every element its own run
    for name in emap.tensors:  # reading back gives the checkpoint, bit for bit
        assert torch.equal(weights.live.read(name).view(torch.int16), ckpt[name].view(torch.int16))
    assert weights.held.state_digest == state_digest(ckpt)


def test_packed_weights_are_refused():
    model = FusedModel()
    model.qkv = torch.nn.Parameter(torch.empty(0, dtype=BF16), requires_grad=False)
    with pytest.raises(MapError, match="empty"):
        build_map(model, {"q.weight": ("BF16", [4, 4])}, key="x")


def _delta(ckpt, new, base_commitment, version=1):
    return DeltaFile.from_bytes(encode_delta(ckpt, new, version=version, base_version=version - 1,
                                             base_commitment=base_commitment))


def _changed(ckpt, seed=1, fraction=0.3):
    g = torch.Generator().manual_seed(seed)
    new = {}
    for n, t in ckpt.items():
        bits = t.reshape(-1).view(torch.int16).clone()
        mask = torch.rand(bits.numel(), generator=g) < fraction
        bits[mask] ^= 5
        new[n] = bits.view(BF16).view(t.shape)
    new["lm_head.weight"] = new["embed.weight"].clone()
    return new


def test_stage_write_audit_revert(loaded):
    ckpt, model, emap, weights = loaded
    c0 = genesis_commitment(state_fingerprint_of(ckpt))
    weights.adopt(version=0, commitment=c0, state_digest=state_digest(ckpt))
    new = _changed(ckpt)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    staged = weights.stage(_delta(ckpt, new, c0))
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # staging writes nothing
    weights.write(staged)
    assert weights.audit(staged) == []
    assert weights.live_state_digest() == state_digest(new) == weights.held.state_digest
    assert weights.held.version == 1
    assert torch.equal(model.embed[10:], torch.zeros(6, 4, dtype=BF16))  # padding untouched
    weights.revert(staged)
    assert weights.live_state_digest() == state_digest(ckpt) and weights.held.version == 0
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_refusals_leave_weights_untouched(loaded):
    ckpt, model, emap, weights = loaded
    c0 = genesis_commitment(state_fingerprint_of(ckpt))
    weights.adopt(version=0, commitment=c0, state_digest=state_digest(ckpt))
    before = weights.live_state_digest()
    new = _changed(ckpt)
    with pytest.raises(DeltaError) as e:  # built on another chain
        weights.stage(_delta(ckpt, new, "f" * 64))
    assert e.value.reason == "wrong_base"
    with pytest.raises(DeltaError) as e:  # out of order
        weights.stage(_delta(ckpt, new, c0, version=3))
    assert e.value.reason == "out_of_order"
    other = {n: t.clone() for n, t in ckpt.items()}  # right commitment, wrong bits underneath
    other["o.weight"].view(-1).view(torch.int16)[:5] ^= 1
    with pytest.raises(DeltaError) as e:  # sparse enough that most of the five stay unchanged
        weights.stage(_delta(other, _changed(other, fraction=0.02), c0))
    assert e.value.reason in ("digest_mismatch", "wrong_base")
    assert weights.live_state_digest() == before and weights.held.version == 0


def test_policy_fields_single_and_mixed():
    assert policy_fields({0: [("4", 0, 8)], 1: [("4", 0, 3)]}, "4") == {"policy_version": 4}
    assert policy_fields({}, "base") == {"policy_version": None}
    mixed = policy_fields({0: [("4", 0, 5), ("5", 5, 8)]}, "5")
    assert mixed["policy_version"] is None and mixed["policy_versions"] == [4, 5]
    assert mixed["policy_version_spans"] == [[{"version": 4, "start": 0, "end": 5},
                                              {"version": 5, "start": 5, "end": 8}]]
    assert policy_headers(mixed) == {"X-Policy-Versions": "4,5"}
    assert policy_headers(policy_fields({}, "4")) == {"X-Policy-Version": "4"}
    # choices listed by index, whichever finished first (the engine records them as they finish)
    later_first = policy_fields({1: [("5", 0, 2)], 0: [("4", 0, 1), ("5", 1, 9)]}, "5")
    assert [[s["end"] for s in c] for c in later_first["policy_version_spans"]] == [[1, 9], [2]]


def test_a_tensor_kept_in_another_dtype_stages_through_torch_beside_the_gathered_ones():
    """An engine that keeps a norm in fp32 under a bf16 checkpoint: that tensor cannot be gathered
    as bits, so its decoded batch goes tensor by tensor (the others still gathered, the norm
    through torch); the version lands exactly and reverts exactly."""
    model = FusedModel()
    model.norm = torch.nn.Parameter(torch.zeros(4, dtype=torch.float32), requires_grad=False)
    ckpt, model, _, weights = _load(model, "test-fp32-norm")
    c0 = genesis_commitment(state_fingerprint_of(ckpt))
    weights.adopt(version=0, commitment=c0, state_digest=state_digest(ckpt))
    new = _changed(ckpt, seed=2, fraction=0.2)
    delta = _delta(ckpt, new, c0)
    batches, _ = delta.decode_batches([n for n, e in delta.header.tensors.items() if e.encoding != "same"])
    assert [b.names for b in batches] == [["embed.weight", "k.weight", "lm_head.weight", "norm.weight", "o.weight",
                                           "q.weight", "v.weight"]]  # a batch mixing both
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    staged = weights.stage(delta)
    assert {p.name: p.target.dtype for p in staged.patches if p.name in ("k.weight", "norm.weight")} == \
        {"k.weight": torch.int16, "norm.weight": torch.float32}
    weights.write(staged)
    assert weights.audit(staged) == []
    assert weights.live_state_digest() == state_digest(new) == weights.held.state_digest
    weights.revert(staged)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_failure_in_the_middle_of_a_write_is_rolled_back(loaded):
    ckpt, model, emap, weights = loaded
    c0 = genesis_commitment(state_fingerprint_of(ckpt))
    weights.adopt(version=0, commitment=c0, state_digest=state_digest(ckpt))
    staged = weights.stage(_delta(ckpt, _changed(ckpt), c0))
    assert len(staged.patches) > 3

    def boom() -> None:
        raise RuntimeError("write failed")

    staged.patches[3].apply = boom  # the first three are written, then the fourth fails
    with pytest.raises(RuntimeError):
        weights.write(staged)
    assert weights.live_state_digest() == state_digest(ckpt)
    assert weights.held.version == 0 and weights.held.commitment == c0


def test_staging_predicts_fingerprints_in_o_changes(loaded, monkeypatch):
    """Through fused, padded and transposed parameters, the held fingerprints follow every
    version, staging predicts them without a whole-tensor hash, and a wrong bit underneath a
    changed position is refused by fingerprint before anything is written."""
    import rollout_space.live_weights as live_weights

    ckpt, model, emap, weights = loaded
    assert weights.held.fingerprints == {n: tensor_fingerprint(t).hex() for n, t in ckpt.items()}
    c0 = genesis_commitment(state_fingerprint_of(ckpt))
    weights.adopt(version=0, commitment=c0, state_digest=state_digest(ckpt))
    whole = []
    real = live_weights.holds
    monkeypatch.setattr(live_weights, "holds", lambda entry, t: whole.append(t) or real(entry, t))
    new = _changed(ckpt, fraction=0.05)
    delta = _delta(ckpt, new, c0)
    staged = weights.stage(delta)
    sent_whole = [n for n, e in delta.header.tensors.items() if e.positions == "all" and n in emap.tensors]
    assert len(whole) == len(sent_whole) < len(staged.touched)  # only tensors sent whole are hashed whole
    weights.write(staged)
    assert weights.audit(staged) == []
    assert weights.held.fingerprints == {n: tensor_fingerprint(t).hex() for n, t in new.items()}
    monkeypatch.undo()
    # live bits at a position the next delta changes are not the held ones: refused, nothing written
    nxt = _changed(new, seed=2, fraction=0.05)
    pos = int((new["o.weight"].view(torch.int16) != nxt["o.weight"].view(torch.int16)).reshape(-1).nonzero()[0])
    patch_to(weights, "o.weight", pos, new["o.weight"].reshape(-1).view(torch.int16)[pos] ^ 3)
    before = weights.live_state_digest()
    with pytest.raises(DeltaError, match="fingerprint") as e:
        weights.stage(_delta(new, nxt, staged.header.commitment, version=2))
    assert e.value.reason == "digest_mismatch" and weights.live_state_digest() == before


def patch_to(weights, name: str, pos: int, bits: torch.Tensor) -> None:
    """Write one element of a checkpoint tensor straight into the engine (a stray write)."""
    (pl,) = weights.live.locate(name, torch.tensor([pos]))
    target = weights.live.flats[pl.param].view(torch.int16)
    target[pl.dest] = bits.to(torch.int16)


@pytest.mark.parametrize("digests", ["known", "unknown"])
def test_rolling_audit_covers_every_tensor_every_k_versions_and_finds_a_stray_write(loaded, digests, monkeypatch):
    """By blake3 digest where it is known, by fingerprint where it is not (after deltas published
    without digests): either way every tensor once per K calls, and a flipped bit found."""
    import rollout_space.live_weights as live_weights

    ckpt, model, emap, weights = loaded
    if digests == "unknown":
        weights.held.digests.update({n: "" for n in emap.tensors})
    hashed = []
    real = live_weights.tensor_digest
    monkeypatch.setattr(live_weights, "tensor_digest", lambda t: hashed.append(t) or real(t))
    rounds = [weights.rolling_audit() for _ in range(weights.audit_every)]
    assert len(hashed) == (len(emap.tensors) if digests == "known" else 0)
    assert sorted(n for audited, _ in rounds for n in audited) == sorted(emap.tensors)
    assert all(drifted == [] for _, drifted in rounds)
    patch_to(weights, "v.weight", 7, ckpt["v.weight"].reshape(-1).view(torch.int16)[7] ^ 1)
    found = [d for _ in range(weights.audit_every) for d in weights.rolling_audit()[1]]
    assert found == ["v.weight"]


def test_read_back_audit_finds_a_write_that_did_not_land(loaded):
    ckpt, model, emap, weights = loaded
    c0 = genesis_commitment(state_fingerprint_of(ckpt))
    weights.adopt(version=0, commitment=c0, state_digest=state_digest(ckpt))
    staged = weights.stage(_delta(ckpt, _changed(ckpt), c0))
    weights.write(staged)
    p = next(p for p in staged.patches if p.positions is not None and p.positions.numel() > 1)
    p.target[p.positions[1]] = p.old[1]  # one written element reverts behind the audit's back
    assert weights.audit(staged) == [p.name]


# ----------------------------------------------------------------------------- ranks
def rank_map(emap: EngineMap, rank: int, world: int = 2) -> EngineMap:
    """This rank's share of a one-rank map, the way tensor parallelism splits one: every run cut
    in two and the pieces dealt out in turn (so each rank holds part of every tensor), except the
    norm, which every rank holds whole (replicated, like vLLM's)."""
    tensors = {}
    for name, t in emap.tensors.items():
        if name == "norm.weight":
            tensors[name] = t
            continue
        pieces = []
        for s, n, p, ps in zip(t.hf_start, t.length, t.param, t.param_start):
            h = n // 2
            pieces += [(s, h, p, ps), (s + h, n - h, p, ps + h)] if h else [(s, n, p, ps)]
        mine = pieces[rank::world]
        tensors[name] = t.model_copy(update={k: [piece[i] for piece in mine] for i, k in
                                             enumerate(("hf_start", "length", "param", "param_start"))})
    return emap.model_copy(update={"tensors": tensors, "rank": rank, "world": world})


@pytest.fixture
def ranks(loaded):
    """Two ranks over one model, each holding part of every tensor but the norm (whole on both)."""
    ckpt, model, emap, _ = loaded
    specs = {n: (SAFETENSORS_DTYPES[t.dtype], list(t.shape)) for n, t in ckpt.items()}
    out = []
    for r in range(2):
        live = LiveMap(rank_map(emap, r), model)
        declared = [n for n in ckpt if n not in live.map.tensors or not live.whole(n)]
        w = LiveWeights(model, live, specs, {n: tensor_digest(ckpt[n]) for n in declared},
                        {n: tensor_fingerprint(ckpt[n]).hex() for n in declared}, audit_every=3)
        w.read_back()
        out.append(w)
    c0 = genesis_commitment(state_fingerprint_of(ckpt))
    for w in out:
        w.adopt(version=0, commitment=c0, state_digest=state_digest(ckpt))
    return ckpt, model, out, c0


def _shards(ranks, full):
    return [{n: (w.held.fingerprints[n], full[n]) for n in w.split()} for w in ranks]


def test_ranks_partial_fingerprints_add_up_and_follow_every_version(ranks):
    """Each rank stages and writes only its own positions, keeps the partial fingerprint of its
    elements, and the partials add up to the delta's declared fingerprint."""
    ckpt, model, ws, c0 = ranks
    full = {n: tensor_fingerprint(t).hex() for n, t in ckpt.items()}
    assert set(ws[0].split()) == set(ws[1].split()) == set(ckpt) - {"norm.weight", "lm_head.weight"}
    assert check_shards(_shards(ws, full)) == []
    assert ws[0].held.fingerprints["q.weight"] != full["q.weight"]  # a partial, not the whole
    new = _changed(ckpt, fraction=0.05)
    delta = _delta(ckpt, new, c0)
    staged = [w.stage(delta) for w in ws]  # all ranks stage before any writes, as the server does
    assert check_shards([s.shards for s in staged]) == []
    assert sum(len(s.patches) for s in staged) > len(staged[0].touched)  # the work is split
    for w, s in zip(ws, staged):
        w.write(s)
        assert w.audit(s) == []
    want = {n: tensor_fingerprint(t).hex() for n, t in new.items()}
    assert check_shards(_shards(ws, want)) == []
    live = {n: torch.cat([r for _, r in sorted(list(ws[0].live.runs(n)) + list(ws[1].live.runs(n)),
                                                key=lambda x: x[0])]) for n in ws[0].split()}
    assert all(torch.equal(live[n].view(torch.int16), new[n].reshape(-1).view(torch.int16)) for n in live)
    assert all(w.rolling_audit()[1] == [] for w in ws for _ in range(w.audit_every))
    # a stray write into one rank's share: that rank's rolling audit finds it, the other's does not
    pos = int(ws[1].live.map.tensors["embed.weight"].hf_start[0])
    patch_to(ws[1], "embed.weight", pos, new["embed.weight"].reshape(-1).view(torch.int16)[pos] ^ 1)
    found = [[d for _ in range(w.audit_every) for d in w.rolling_audit()[1]] for w in ws]
    assert found == [[], ["embed.weight"]]


def test_ranks_refuse_a_delta_whose_parts_do_not_add_up(ranks):
    """Wrong bits underneath positions one rank changes: each rank's own check cannot see it
    (it holds only a part), the sum over ranks does, before anything is written."""
    ckpt, model, ws, c0 = ranks
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    other = {n: t.clone() for n, t in ckpt.items()}  # right commitment, wrong bits underneath
    other["q.weight"].view(-1).view(torch.int16)[:16] ^= 1
    nxt = {n: t.clone() for n, t in other.items()}
    nxt["q.weight"].view(-1).view(torch.int16)[:16] ^= 6
    staged = [w.stage(_delta(other, nxt, c0)) for w in ws]
    assert check_shards([s.shards for s in staged]) == ["q.weight"]
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert [w.held.version for w in ws] == [0, 0]
    # overlapping shares cannot add up either: rank 0's share counted twice
    assert check_shards([staged[0].shards, staged[0].shards]) != []
