"""Change detection with torch ops where the weights live (run here on the CPU): it must find
exactly what the numba scan finds, and a publisher that uses it must write the same chain."""

from __future__ import annotations

import numpy as np
import pytest
import safetensors.torch
import torch

from shared.chain import AnchorPolicy, Chain, reconstruct
from shared.changes import CHUNK_ELEMENTS, find_changes
from shared.codec import DeltaFile
from shared.digest import state_digest
from shared.publisher import DeltaPublisher
from shared.stores import open_store

from .helpers import adamw_steps, bits_state, perturb, same_bits

INT = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
# bit patterns that float comparison gets wrong: -0 vs +0, NaNs with different payloads, equal NaNs
SPECIAL = {torch.bfloat16: [0x0000, 0x8000, 0x7FC0, 0x7FC1, 0xFFC0, 0x7F80, 0x0001],
           torch.float32: [0x00000000, 0x80000000, 0x7FC00000, 0x7FC00001, 0xFFC00000, 0x7F800000, 0x00000001]}


def sparse_change(base: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """``base`` with about ``fraction`` of its elements given new bits: one-ulp steps, random
    bits, and special patterns written over special patterns (some of them the same bits)."""
    g = torch.Generator().manual_seed(seed)
    iv = INT[base.dtype]
    new = base.clone().view(-1).view(iv)
    n = new.numel()
    k = max(1, int(n * fraction))
    new[torch.randint(0, n, (k,), generator=g)] ^= 1
    new[torch.randint(0, n, (k // 4,), generator=g)] = torch.randint(-2**15, 2**15, (k // 4,), generator=g).to(iv)
    special = torch.tensor(SPECIAL[base.dtype], dtype=torch.int64).to(iv)
    at = torch.randint(0, n, (2 * len(special),), generator=g)
    new[at] = special.repeat(2)
    return new.view(base.dtype).view(base.shape)


def with_specials(base: torch.Tensor, seed: int) -> torch.Tensor:
    """Put every special pattern into the base too, so some changes go from one to another."""
    g = torch.Generator().manual_seed(seed)
    iv = INT[base.dtype]
    flat = base.view(-1).view(iv)
    special = torch.tensor(SPECIAL[base.dtype], dtype=torch.int64).to(iv)
    flat[torch.randint(0, flat.numel(), (4 * len(special),), generator=g)] = special.repeat(4)
    return base


def both(old: torch.Tensor, new: torch.Tensor, **kw):
    """Run both backends on their own copies of ``old``; return results and snapshots after."""
    a, b = old.clone(), old.clone()
    return find_changes(a, new, backend="numba", **kw), find_changes(b, new, backend="torch", **kw), a, b


def bits(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(INT[t.dtype]).numpy()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("numel,fraction", [(4099, 0.01), (70001, 0.03), (CHUNK_ELEMENTS + 3001, 0.01)])
def test_torch_path_equals_numba_path(dtype, numel, fraction):
    old = with_specials(bits_state(numel, {"t": ((numel,), dtype)})["t"], seed=numel)
    new = sparse_change(old, fraction, seed=numel + 1)
    ra, rb, after_a, after_b = both(old, new, update=True)
    assert ra is not None and rb is not None and ra.count > 0
    assert np.array_equal(ra.positions, rb.positions) and rb.positions.dtype == np.int64
    assert ra.xor.dtype == rb.xor.dtype and np.array_equal(ra.xor, rb.xor)
    # old and new bits at the positions, as each side reconstructs them
    old_at, new_at = bits(old)[rb.positions], bits(new)[rb.positions]
    assert np.array_equal(old_at.view(rb.xor.dtype) ^ rb.xor, new_at.view(rb.xor.dtype))
    assert np.array_equal(rb.positions, np.flatnonzero(bits(old) != bits(new)))
    assert np.array_equal(bits(after_a), bits(new)) and np.array_equal(bits(after_b), bits(new))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tiny_tensors(dtype):
    """One element may change in a tensor of up to 16 (cap 1); two in seven is dense."""
    old = torch.tensor([-0.0], dtype=dtype)
    ra, rb, after_a, after_b = both(old, torch.tensor([0.0], dtype=dtype), update=True)
    assert ra.positions.tolist() == rb.positions.tolist() == [0]
    assert np.array_equal(ra.xor, rb.xor) and int(rb.xor[0]) == 1 << (8 * old.element_size() - 1)
    assert bits(after_a).tolist() == bits(after_b).tolist() == [0]
    old = torch.full((7,), float("nan"), dtype=dtype)
    new = old.clone()
    new[[2, 5]] = 0.0
    ra, rb, after_a, after_b = both(old, new, update=True)
    assert ra is None and rb is None and np.array_equal(bits(after_b), bits(old))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_no_change_and_no_update(dtype):
    old = bits_state(3, {"t": ((5000,), dtype)})["t"]
    ra, rb, _, _ = both(old, old.clone(), update=True)
    assert ra.count == rb.count == 0
    new = sparse_change(old, 0.01, seed=4)
    ra, rb, after_a, after_b = both(old, new, update=False)
    assert np.array_equal(ra.positions, rb.positions) and np.array_equal(ra.xor, rb.xor)
    assert np.array_equal(bits(after_a), bits(old)) and np.array_equal(bits(after_b), bits(old))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dense_rule_is_per_chunk_on_both_paths(dtype):
    """Sparse overall, dense in the short last chunk: both say None and leave the snapshot."""
    numel = CHUNK_ELEMENTS + 100
    old = bits_state(5, {"t": ((numel,), dtype)})["t"]
    new = old.clone()
    flat = new.view(-1).view(INT[dtype])
    flat[CHUNK_ELEMENTS + 10:CHUNK_ELEMENTS + 30] ^= 1  # 20 changes; that chunk's cap is 100 // 16 + 1
    ra, rb, after_a, after_b = both(old, new, update=True)
    assert ra is None and rb is None
    assert np.array_equal(bits(after_a), bits(old)) and np.array_equal(bits(after_b), bits(old))
    flat[CHUNK_ELEMENTS + 13:CHUNK_ELEMENTS + 30] ^= 1  # undone
    ra, rb, _, _ = both(old, new, update=True)  # 3 changes: sparse again
    assert ra.count == rb.count == 3 and np.array_equal(ra.positions, rb.positions)


def test_backend_argument_is_checked():
    t = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="backend"):
        find_changes(t, t.clone(), backend="cuda")
    with pytest.raises(ValueError, match="mismatch"):
        find_changes(t, torch.zeros(4, dtype=torch.float32), backend="torch")


def lockstep(live, tmp_path, steps, compact: bool = False, **kw) -> tuple[list[dict], dict[str, DeltaPublisher]]:
    """Two publishers over the same live tensors, one per backend; ``steps`` changes them."""
    pubs = {d: DeltaPublisher(live, str(tmp_path / d), detect=d, keep_anchors=100, compact=compact,
                              policy=AnchorPolicy(max_deltas=3), **kw) for d in ("numba", "torch")}
    states = [{n: t.detach().clone() for n, t in pubs["torch"]._live().items()}]
    for _ in steps:
        for p in pubs.values():
            p.publish()
        states.append({n: t.detach().clone() for n, t in pubs["torch"]._live().items()})
    for p in pubs.values():
        p.close()
    return states, pubs


def assert_same_chains(tmp_path, pubs: dict[str, DeltaPublisher], versions: int) -> Chain:
    """The same objects in both stores (same headers, hence same payload digests and
    commitments, and the same tensors), so the torch path's chain is the numba path's.
    Files are not compared byte for byte: safetensors writes metadata keys in no fixed order."""
    stores = {d: open_store(tmp_path / d) for d in pubs}
    keys = [k for d in ("anchors", "deltas") for k in stores["numba"].list(d)]
    assert keys == [k for d in ("anchors", "deltas") for k in stores["torch"].list(d)]
    assert sum(k.startswith("deltas/") for k in keys) == versions
    for k in keys:
        a, b = (stores[d].get(k) for d in ("numba", "torch"))
        assert DeltaFile.from_bytes(a).header == DeltaFile.from_bytes(b).header, k
        assert same_bits(safetensors.torch.load(a), safetensors.torch.load(b)), k
    timings = {"encode_s": 0, "encoder_s": 0, "encoder_parts": {}, "upload_s": 0, "notify_s": 0}
    assert [r.as_dict() | timings for r in pubs["numba"].reports] == [r.as_dict() | timings for r in pubs["torch"].reports]
    return Chain(stores["torch"])


def test_publisher_torch_path_mixed_state(tmp_path):
    """bf16 and f32 tensors with sparse changes and specials, dense changes two versions in a
    row (the second time the publisher copies the tensor without a scan, and its encoder finds
    the change), followed by no change or a sparse one, an integer buffer; a spare buffer is
    held after the last version only for the tensor that changed in more than 1/64 of it."""
    live = bits_state(11, {"a.weight": ((300, 64), torch.bfloat16), "b.weight": ((2000,), torch.float32),
                           "c.norm": ((64,), torch.bfloat16), "e.weight": ((300, 64), torch.bfloat16)})
    live["d.steps"] = torch.arange(10, dtype=torch.int64)

    def steps():
        for i in range(5):
            for n in ("a.weight", "b.weight"):
                live[n].copy_(sparse_change(live[n], 0.01, seed=100 + i))
            if i in (2, 3):
                live["c.norm"].copy_(perturb({"c": live["c.norm"]}, 0.5, seed=7 + i)["c"])  # dense, then none
            if i in (1, 2):
                live["e.weight"].copy_(perturb({"e": live["e.weight"]}, 0.5, seed=20 + i)["e"])  # dense
            if i == 3:
                live["e.weight"].copy_(sparse_change(live["e.weight"], 0.01, seed=30))  # then sparse
            if i == 3:
                live["d.steps"] += 1
            yield

    states, pubs = lockstep(live, tmp_path, steps(), dtype=None)
    chain = assert_same_chains(tmp_path, pubs, versions=5)
    for v, s in enumerate(states):
        state, header = reconstruct(chain, v)
        assert same_bits(state, s) and header.state_digest == state_digest(s)
    assert pubs["torch"]._device_snapshot.keys() == live.keys()
    assert same_bits(pubs["torch"]._device_snapshot, live) and same_bits(pubs["torch"]._snapshot, live)
    last = {n: int(torch.count_nonzero(states[-2][n].view(-1).view(INT.get(t.dtype, t.dtype)) !=
                                      states[-1][n].view(-1).view(INT.get(t.dtype, t.dtype)))) for n, t in live.items()}
    assert set(pubs["numba"]._spare) == {n for n, k in last.items() if k > live[n].numel() / 64} == {"b.weight"}


@pytest.mark.parametrize("copy_from", [None, 0.0], ids=["busy-copied", "all-copied"])
def test_publisher_fp32_weights_dense_then_sparse(tmp_path, copy_from):
    """fp32 weights published as bf16 that change densely two versions in a row (the second
    without a scan: cast into the publisher's spare buffer), then sparsely, then not at all: the
    same chain as the torch path, every version exact, and no buffer left held; or with
    ``copy_from=0`` every tensor copied every version, and a spare held for each."""
    g = torch.Generator().manual_seed(12)
    live = {"a.weight": torch.randn(300, 64, generator=g), "b.weight": torch.randn(2000, generator=g)}

    def steps():  # finite normal weights: the fused cast takes them (NaNs would go the one-tensor way)
        for fraction in [0.5, 0.5, 0.01, 0.0]:
            for t in live.values():
                at = torch.randperm(t.numel(), generator=g)[:int(t.numel() * fraction)]
                t.view(-1)[at] = torch.randn(at.numel(), generator=g)
            yield

    kw = {} if copy_from is None else {"copy_from": copy_from}
    states, pubs = lockstep(live, tmp_path, steps(), dtype=torch.bfloat16, **kw)
    chain = assert_same_chains(tmp_path, pubs, versions=4)
    numel = sum(t.numel() for t in live.values())
    dense1, dense2, sparse, none = (r.changed for r in pubs["numba"].reports[1:])  # after the anchor
    assert dense1 > numel / 3 and dense2 > numel / 3 and 0 < sparse < numel / 50 and none == 0
    for v, s in enumerate(states):
        state, _ = reconstruct(chain, v)
        assert same_bits(state, {n: t.to(torch.bfloat16) for n, t in s.items()})
    assert set(pubs["numba"]._spare) == (set() if copy_from is None else set(live))
    with pytest.raises(ValueError, match="copy_from"):
        DeltaPublisher(live, str(tmp_path / "refused"), copy_from=1.5)


@pytest.mark.parametrize("per_chunk", [[0.0, 0.0], [0.001, 0.01], [0.05, 0.05], [0.07, 0.01], [0.2, 0.2], [0.6, 0.5]],
                         ids=["none", "sparse", "sparse-above-one-cap", "one-chunk-dense", "dense", "most"])
def test_publisher_busy_tensor_follows_the_per_chunk_rule(tmp_path, per_chunk):
    """A tensor busy since a dense change (publish() copies it, the encoder finds the change from
    the old and new bits): over two chunks the dense rule is per chunk, so 5% + 5% is sparse and
    7% + 1% dense, as a scan says; the chain is the torch path's, every version rebuilds exactly,
    a change keeps its positions unless it is of more than half the elements (the first version
    here 20%, dense for a scan; 55% in "most"), and the spare buffer is held only while the
    tensor is busy."""
    rng = np.random.default_rng(2)
    live = {"t": torch.from_numpy(rng.integers(0, 1 << 16, 2 * CHUNK_ELEMENTS, dtype=np.uint16).view(np.int16))
            .view(torch.bfloat16)}
    pubs = {d: DeltaPublisher(live, str(tmp_path / d), detect=d, dtype=None, keep_anchors=100,
                              policy=AnchorPolicy(max_deltas=3)) for d in ("numba", "torch")}
    states, expected, busy = [live["t"].clone()], [], []
    for fractions in ([0.2, 0.2], per_chunk, [0.0, 0.0]):
        flat = live["t"].view(torch.int16).numpy().view(np.uint16)
        for c, fraction in enumerate(fractions):
            at = c * CHUNK_ELEMENTS + rng.choice(CHUNK_ELEMENTS, int(CHUNK_ELEMENTS * fraction), replace=False)
            flat[at] ^= rng.integers(1, 1 << 16, at.shape[0], dtype=np.uint16)
        expected.append(int(torch.count_nonzero(states[-1].view(torch.int16) != live["t"].view(torch.int16))))
        for p in pubs.values():
            p.publish()
        pubs["numba"].flush()
        busy.append("t" in pubs["numba"]._spare)
        states.append(live["t"].clone())
    for p in pubs.values():
        p.close()
    chain = assert_same_chains(tmp_path, pubs, versions=3)
    for v, s in enumerate(states):
        state, _ = reconstruct(chain, v)
        assert same_bits(state, {"t": s})
    deltas = sorted(open_store(tmp_path / "numba").list("deltas"))
    for count, report, key in zip(expected, pubs["numba"].reports[1:], deltas):
        assert report.changed == count
        entry = DeltaFile.from_bytes(open_store(tmp_path / "numba").get(key)).header.tensors["t"]
        assert entry.changed == count
        assert entry.positions == ("all" if count > live["t"].numel() / 2 else "gaps" if count else None)
    assert busy == [True, sum(per_chunk) / 2 > 1 / 64, False]


@pytest.mark.parametrize("compact", [False, True])
def test_publisher_torch_path_on_real_gradients(tiny_model_dir, tmp_path, compact):
    """fp32 master weights, bf16 versions: every version rebuilds exactly, same bytes as numba."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    states, pubs = lockstep(model, tmp_path, adamw_steps(model, 4, lr=1e-5), compact=compact)
    chain = assert_same_chains(tmp_path, pubs, versions=4)
    assert 0 < pubs["torch"].reports[-1].changed < pubs["torch"].reports[-1].numel
    for v, s in enumerate(states):
        state, header = reconstruct(chain, v)
        assert same_bits(state, {n: t.to(torch.bfloat16) for n, t in s.items()})
        assert header.state_digest == pubs["torch"].reports[v].state_digest
