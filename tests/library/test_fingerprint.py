"""The linear tensor fingerprint: numba == torch == the slow reference, shards sum to the whole,
an O(changes) update equals a recompute, and pinned known answers keep the definition fixed."""

from __future__ import annotations

import itertools
import json

import blake3
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import fingerprint as fingerprint_module
from shared.changes import find_changes
from shared.codec import combine
from shared.digest import SAFETENSORS_DTYPES
from shared.fingerprint import (
    ZERO,
    Fingerprint,
    fingerprint_delta,
    delta_lanes,
    fingerprint_deltas,
    add_lanes,
    GatherItem,
    GatherTarget,
    fingerprints,
    gather_batch,
    gather_updates,
    one_run,
    runs_fingerprint,
    state_fingerprint,
    state_fingerprint_of,
    tensor_fingerprint,
)

from . import fingerprint_reference as ref
from .helpers import bits_state, perturb

DTYPES = list(SAFETENSORS_DTYPES)  # every dtype the project stores: 8, 16, 32 and 64 bits
SHAPES = [(), (0,), (0, 3), (1,), (3,), (7, 5), (130,), (3, 1, 17), (2, 3, 11)]
SPECIALS = [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40, -1e-45, 6e-8, 3.0]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int, specials: bool = False) -> torch.Tensor:
    """Random bit patterns (NaN payloads, infinities, -0 and subnormals occur), optionally with the
    special values planted at random places."""
    if dtype == torch.bool:
        return (bits_state(seed, {"t": (shape, torch.uint8)})["t"] & 1).view(torch.bool)
    t = bits_state(seed, {"t": (shape, dtype)})["t"]
    if specials and dtype.is_floating_point and t.numel():
        g = torch.Generator().manual_seed(seed)
        vals = torch.tensor(SPECIALS).to(dtype)
        vals.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])[0] |= 0x3  # NaN payload
        k = min(t.numel(), len(SPECIALS))
        t.reshape(-1)[torch.randperm(t.numel(), generator=g)[:k]] = vals[:k]
    return t


def all_backends(t: torch.Tensor, start: int = 0) -> dict[str, str]:
    """The fingerprint from every implementation and chunking (tiny chunks cross many boundaries)."""
    return {
        "reference": ref.fingerprint_hex(t, start),
        "numba": tensor_fingerprint(t, start=start).hex(),
        "numba-chunks": tensor_fingerprint(t, start=start, backend="numba", chunk=5).hex(),
        "numba-1-thread": tensor_fingerprint(t, start=start, backend="numba", threads=False, chunk=7).hex(),
        "torch": tensor_fingerprint(t, start=start, backend="torch").hex(),
        "torch-chunks": tensor_fingerprint(t, start=start, backend="torch", chunk=3).hex(),
    }


def test_reference_mix_is_splitmix64():
    """splitmix64 seeded with 0 outputs mix(n * gamma) for n = 1, 2, 3: published values."""
    gamma = 0x9E3779B97F4A7C15
    outputs = [ref.mix((n * gamma) & ref.MASK64) for n in (1, 2, 3)]
    assert outputs == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(DTYPES), shape=st.sampled_from(SHAPES), seed=st.integers(0, 2**16),
       start=st.sampled_from([0, 1, 12345, 2**31 - 1, 2**31 + 3, 2**40]), specials=st.booleans())
def test_backends_equal_reference(dtype, shape, seed, start, specials):
    t = random_tensor(dtype, shape, seed, specials)
    got = all_backends(t, start)
    assert set(got.values()) == {got["reference"]}, got


def test_special_bit_patterns_all_backends():
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        t = torch.tensor(SPECIALS).to(dtype)
        t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])[0] |= 0x3
        got = all_backends(t)
        assert set(got.values()) == {got["reference"]}, (dtype, got)
        # -0 and +0 differ, and so do two NaNs with different payloads
        flipped = t.clone()
        flipped.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])[0] ^= 0x1
        assert tensor_fingerprint(flipped) != tensor_fingerprint(t)
        assert tensor_fingerprint(torch.tensor([-0.0]).to(dtype)) != tensor_fingerprint(torch.tensor([0.0]).to(dtype))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(DTYPES), n=st.integers(0, 300), seed=st.integers(0, 2**16),
       cuts=st.lists(st.integers(0, 300), max_size=5), backend=st.sampled_from(["numba", "torch"]))
def test_shards_sum_to_whole(dtype, n, seed, cuts, backend):
    t = random_tensor(dtype, (n,), seed)
    bounds = sorted({0, n, *(min(c, n) for c in cuts)})
    parts = [tensor_fingerprint(t[a:b], start=a, backend=backend) for a, b in itertools.pairwise(bounds)]
    assert sum(parts, ZERO) == tensor_fingerprint(t)


def test_row_shards_of_a_matrix_sum_to_whole():
    """Tensor-parallel row shards are flat ranges: each rank's partial uses its global start."""
    t = random_tensor(torch.bfloat16, (12, 40), 3)
    ranks = [t[r * 3:(r + 1) * 3] for r in range(4)]
    partials = [tensor_fingerprint(s, start=r * 3 * 40) for r, s in enumerate(ranks)]
    assert sum(partials) == tensor_fingerprint(t)
    assert sum(partials[:3]) != tensor_fingerprint(t)  # a missing shard shows


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(DTYPES), shape=st.sampled_from([(1,), (7, 5), (130,), (64, 33)]),
       fraction=st.sampled_from([0.0, 0.01, 0.1, 1.0]), seed=st.integers(0, 2**16),
       backend=st.sampled_from(["numba", "torch"]))
def test_incremental_update_equals_recompute(dtype, shape, fraction, seed, backend):
    old = random_tensor(dtype, shape, seed)
    new = perturb({"t": old}, fraction, seed + 1)["t"]
    if dtype == torch.bool:
        new = (new.view(torch.uint8) & 1).view(torch.bool)
    o = old.reshape(-1).view(torch.uint8).view(-1, old.element_size())
    n = new.reshape(-1).view(torch.uint8).view(-1, new.element_size())
    pos = torch.nonzero((o != n).any(1)).reshape(-1)
    width = 8 * old.element_size()
    delta = fingerprint_delta(pos, old.reshape(-1)[pos], new.reshape(-1)[pos], width, backend=backend)
    assert tensor_fingerprint(old) + delta == tensor_fingerprint(new)
    assert tensor_fingerprint(new) - delta == tensor_fingerprint(old)
    # unchanged positions included add nothing
    every = torch.arange(old.numel())
    assert fingerprint_delta(every, old.reshape(-1), new.reshape(-1), width, backend=backend) == delta


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtypes=st.lists(st.sampled_from(DTYPES), min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_batched_updates_equal_one_at_a_time(dtypes, seed):
    """One numba call for many tensors (what a replica's staging makes) gives each its own update,
    whatever mix of widths (64-bit ones go one at a time) and empty pieces."""
    items = []
    for k, dtype in enumerate(dtypes):
        old = random_tensor(dtype, (37,), seed + k).reshape(-1)
        new = perturb({"t": old}, 0.2 * (k % 3), seed + k + 100)["t"].reshape(-1)
        pos = torch.randperm(37, generator=torch.Generator().manual_seed(seed + k))[: 5 * (k % 4)]
        items.append((pos, old[pos], new[pos], 8 * old.element_size()))
    assert fingerprint_deltas(items) == [fingerprint_delta(*item) for item in items]
    assert fingerprint_deltas([]) == []
    bad = items[0][0].clone()
    if bad.numel():
        bad[0] = -1
        with pytest.raises(ValueError, match=">= 0"):
            fingerprint_deltas([(bad, *items[0][1:])])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(width=st.sampled_from([8, 16, 32]), sizes=st.lists(st.integers(0, 40), min_size=0, max_size=6),
       seed=st.integers(0, 2**16))
def test_delta_lanes_equal_fingerprint_delta(width, sizes, seed):
    """The publisher's numpy path (lanes of every touched tensor in one call, added to the hex
    fingerprints) gives each tensor what ``fingerprint_delta`` adds to it, and refuses a
    negative index or bits of another width."""
    rng = np.random.default_rng(seed)
    u = {8: np.uint8, 16: np.uint16, 32: np.uint32}[width]
    items = [(np.sort(rng.choice(1000, n, replace=False)).astype(np.int64), rng.integers(0, 2**width, n, dtype=u),
              rng.integers(0, 2**width, n, dtype=u)) for n in sizes]
    base = [tensor_fingerprint(random_tensor(torch.float32, (9,), seed + k)).hex() for k in range(len(items))]
    want = [(Fingerprint.from_hex(b) + fingerprint_delta(i, o, n, width)).hex() for b, (i, o, n) in zip(base, items)]
    bounds = np.cumsum([0, *sizes])
    joined = [np.concatenate([item[k] for item in items]) if items else np.empty(0, d)
              for k, d in enumerate((np.int64, u, u))]
    assert add_lanes(base, delta_lanes(*joined, bounds, width)) == want
    if items and sizes[0]:
        i, o, n = joined
        with pytest.raises(ValueError, match=">= 0"):
            delta_lanes(np.concatenate([[-1], i[1:]]), o, n, bounds, width)
        with pytest.raises(ValueError, match=f"{width}-bit"):
            delta_lanes(i, o.astype(np.uint64), n, bounds, width)
        with pytest.raises(ValueError, match="cover"):  # segments past the elements
            delta_lanes(i, o, n, np.concatenate([bounds[:-1], [bounds[-1] + 1]]), width)


def test_batched_updates_split_over_threads(monkeypatch):
    """A large batch is cut into runs of segments on the chunk threads: each segment still gets
    its own update, and a negative index in any run is refused."""
    monkeypatch.setattr(fingerprint_module, "SPLIT_MIN", 1)
    items = []
    for k in range(7):
        old = random_tensor(torch.bfloat16, (64,), k).reshape(-1)
        new = perturb({"t": old}, 0.3, k + 100)["t"].reshape(-1)
        pos = torch.arange(0, 64, k + 1)
        items.append((pos, old[pos], new[pos], 16))
    assert fingerprint_deltas(items) == [fingerprint_delta(*item) for item in items]
    bad = items[-1][0].clone()
    bad[-1] = -1
    with pytest.raises(ValueError, match=">= 0"):
        fingerprint_deltas(items[:-1] + [(bad, *items[-1][1:])])


def held_runs(numel: int, cuts: list[int], keep: list[bool], gap: int) -> np.ndarray:
    """A rank's share of a tensor as :attr:`GatherTarget.runs`: the tensor cut at ``cuts``, the
    pieces kept where ``keep`` says, laid out in order in a parameter from ``gap`` with ``gap``
    elements between them (another tensor's)."""
    bounds = sorted({0, numel, *(min(c, numel) for c in cuts)})
    rows, at = [], gap
    for k, (a, b) in enumerate(itertools.pairwise(bounds)):
        if keep[k % len(keep)]:
            rows.append((a, b - a, at))
            at += b - a + gap
    return np.array(rows, dtype=np.int64).reshape(-1, 3)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(DTYPES), numel=st.integers(0, 400), cuts=st.lists(st.integers(0, 400), max_size=12),
       keep=st.lists(st.booleans(), min_size=1, max_size=5), gap=st.integers(0, 9), shuffle=st.booleans(),
       backend=st.sampled_from(["numba", "torch"]), chunk=st.sampled_from([None, 1, 7]), seed=st.integers(0, 2**16))
def test_runs_fingerprint_is_the_sum_of_its_runs(dtype, numel, cuts, keep, gap, shuffle, backend, chunk, seed):
    """A rank's partial over its runs, in one call, is the sum of each run's fingerprint at its
    global start, whatever the runs' order and the chunking; the ranks' partials add up to the
    whole tensor's."""
    runs = held_runs(numel, cuts, keep, gap)
    rest = held_runs(numel, cuts, [not k for k in keep], 0)  # the other rank: the pieces not kept
    tensor = random_tensor(dtype, (numel,), seed)
    param = random_tensor(dtype, (int((runs[:, 1] + runs[:, 2]).max(initial=0)) + gap,), seed + 1)
    for start, length, at in runs.tolist():
        param[at:at + length] = tensor[start:start + length]
    if shuffle:
        runs = runs[np.random.default_rng(seed).permutation(len(runs))]
    got = runs_fingerprint(param, runs, backend=backend, chunk=chunk)
    assert got == sum((tensor_fingerprint(tensor[s:s + n], start=s) for s, n, _ in runs.tolist()), ZERO)
    other = runs_fingerprint(tensor, np.stack([rest[:, 0], rest[:, 1], rest[:, 0]], axis=1), backend=backend)
    assert (got + other).hex() == ref.fingerprint_hex(tensor)


def test_runs_fingerprint_of_column_shards_and_refusals():
    """Column shards of a matrix (a run per row, what a row-parallel layer's rank holds) add up
    over ranks; a run outside the given elements is refused."""
    t = random_tensor(torch.bfloat16, (12, 40), 5)
    shards = [t[:, r * 10:(r + 1) * 10].contiguous().reshape(-1) for r in range(4)]
    tables = [np.array([[row * 40 + r * 10, 10, row * 10] for row in range(12)]) for r in range(4)]
    partials = [runs_fingerprint(s, rows) for s, rows in zip(shards, tables)]
    assert sum(partials, ZERO) == tensor_fingerprint(t)
    assert sum(partials[1:], ZERO) != tensor_fingerprint(t)
    with pytest.raises(ValueError, match="runs outside the 120 elements"):
        runs_fingerprint(shards[0], np.array([[0, 11, 110]]))
    with pytest.raises(ValueError, match="negative"):
        runs_fingerprint(shards[0], np.array([[-1, 2, 0]]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(view=st.sampled_from([torch.int16, torch.int32, torch.uint8]),
       tensors=st.lists(st.tuples(st.sampled_from(["xor", "add", "set"]), st.integers(1, 300),
                                  st.sampled_from([0.0, 0.01, 0.3, 1.0]), st.lists(st.integers(0, 300), max_size=8),
                                  st.lists(st.booleans(), min_size=1, max_size=3), st.integers(0, 9)),
                        min_size=1, max_size=4),
       shuffle=st.booleans(), seed=st.integers(0, 2**16))
def test_gathered_updates_are_the_gather_the_rule_and_the_fingerprint_change(view, tensors, shuffle, seed):
    """The replica's staging of tensors held in one parameter, as one run or as a rank's runs,
    several in one call, gives per tensor what plain torch gives: the positions held here, their
    places in the parameter, its old bits there, the new bits by the codec's rule, and what the
    write adds to the fingerprint of the elements held here (against the slow reference)."""
    g = torch.Generator().manual_seed(seed)
    items, befores = [], []
    for k, (mode, numel, fraction, cuts, keep, gap) in enumerate(tensors):
        runs = held_runs(numel, cuts, keep, gap)
        param = random_tensor(view, (int((runs[:, 1] + runs[:, 2]).max(initial=0)) + 7,), seed + 2 * k)
        count = int(numel * fraction)
        pos = torch.randperm(numel, generator=g)[:count]
        pos = pos if shuffle else torch.sort(pos).values
        items.append(GatherItem(GatherTarget(param, runs, numel), pos, random_tensor(view, (count,), seed + 2 * k + 1),
                                mode))
        befores.append(param.clone())
    staged = gather_updates(items)
    assert len(staged) == len(items)
    width = 8 * items[0].where.target.element_size()
    for (held_in, pos, bits, mode), before, got in zip(items, befores, staged):
        param, runs, numel = held_in.target, held_in.runs, held_in.numel
        where = torch.full((numel,), -1, dtype=torch.int64)  # each element's place in the parameter
        for start, length, at in runs.tolist():
            where[start:start + length] = torch.arange(at, at + length)
        here = where[pos] >= 0
        held, dest = pos[here], where[pos][here]
        assert (got.dest.dtype, got.old.dtype, got.new.dtype, got.lanes.shape) == (torch.int64, view, view, (4,))
        assert torch.equal(got.positions, held) and torch.equal(got.dest, dest)
        assert (got.positions is pos) == bool(here.all())  # all held: the caller's own positions
        assert torch.equal(got.old, param[dest]) and torch.equal(got.new, combine(mode, got.old, bits[here]))
        expected = [(x - y) % 2**64 for x, y in zip(ref.lanes_at(held.tolist(), ref.words(got.new)[0], width),
                                                    ref.lanes_at(held.tolist(), ref.words(got.old)[0], width))]
        assert got.lanes.tolist() == expected
        assert torch.equal(param, before)  # staging writes nothing
        after = before.clone()
        after[dest] = got.new
        assert add_lanes([runs_fingerprint(before, runs).hex()], got.lanes[None]) == [runs_fingerprint(after, runs).hex()]


def test_gathered_update_refusals():
    param, bits = torch.zeros(10, dtype=torch.int16), torch.zeros(2, dtype=torch.int16)
    fine = GatherItem(GatherTarget(torch.zeros(3, dtype=torch.int16), one_run(3), 3), torch.tensor([0, 2]), bits, "add")

    def item(target, runs, numel, positions, bits, mode):
        return GatherItem(GatherTarget(target, runs, numel), torch.tensor(positions), bits, mode)

    for pos in ([3, 6], [-1, 2]):
        with pytest.raises(ValueError, match="item 1: positions outside the tensor's 6 elements"):
            gather_updates([fine, item(param, one_run(6, 4), 6, pos, bits, "xor")])
    for runs in ([[0, 6, 5]], [[0, 2, 0], [1, 2, 4]], [[2, 2, 0], [0, 2, 4]], [[0, 7, 0]], [[0, -1, 0]]):
        with pytest.raises(ValueError, match="item 0: runs out of order, overlapping or outside the target's "
                                             "10 elements or the tensor's 6"):
            gather_updates([item(param, np.array(runs), 6, [0, 1], bits, "xor")])
    with pytest.raises(ValueError, match="unknown rule"):
        gather_updates([item(param, one_run(10), 10, [0, 1], bits, "or")])
    with pytest.raises(ValueError, match="one 16-bit value per position"):
        gather_updates([item(param, one_run(10), 10, [0, 1, 2], bits, "xor")])
    with pytest.raises(ValueError, match="a flat 8-32-bit CPU tensor"):
        GatherTarget(torch.zeros(10, dtype=torch.int64), one_run(10), 10)
    with pytest.raises(ValueError, match="a flat 8-32-bit CPU tensor"):
        GatherTarget(param[::2], one_run(5), 5)
    with pytest.raises(ValueError, match="item 1: a 16-bit target like item 0's"):  # one element width per call
        gather_updates([fine, item(param.int(), one_run(10), 10, [0, 1], bits, "set")])
    assert torch.equal(param, torch.zeros(10, dtype=torch.int16))
    with pytest.raises(ValueError, match="64 hex digits"):
        add_lanes(["ab" * 8], np.zeros((1, 4), np.uint64))
    with pytest.raises(ValueError, match="four lanes per fingerprint"):
        add_lanes(["ab" * 32], np.zeros((2, 4), np.uint64))
    with pytest.raises(ValueError, match="non-hexadecimal"):
        add_lanes(["xy" * 32], np.zeros((1, 4), np.uint64))


def test_gather_batch_reads_joined_changes_and_refuses_a_bad_join():
    """A replica stages a decoded batch straight from its joined arrays: the same as the
    tensors' changes apart; a join that does not add up is refused before anything is read."""
    targets = [GatherTarget(torch.arange(10, dtype=torch.int16), one_run(10), 10),
               GatherTarget(torch.arange(100, 106, dtype=torch.int16), one_run(6), 6)]
    positions, bits = torch.tensor([1, 4, 0, 5]), torch.tensor([7, 7, 1, 1], dtype=torch.int16)
    modes, bounds = ["set", "xor"], np.array([0, 2, 4])
    got = gather_batch(targets, modes, positions, bits, bounds)
    assert [(g.positions.tolist(), g.dest.tolist(), g.old.tolist(), g.new.tolist()) for g in got] == \
        [([1, 4], [1, 4], [1, 4], [7, 7]), ([0, 5], [0, 5], [100, 105], [101, 104])]
    apart = gather_updates([GatherItem(t, positions[a:b], bits[a:b], m)
                            for t, m, a, b in zip(targets, modes, bounds[:-1], bounds[1:])])
    assert [g.lanes.tolist() for g in got] == [g.lanes.tolist() for g in apart]
    for bad in ([0, 2], [0, 3, 2], [1, 2, 4], [0, 2, 5]):
        with pytest.raises(ValueError, match="bounds from 0 to 4, one more than the 2 targets"):
            gather_batch(targets, modes, positions, bits, np.array(bad))
    for p, b in ((positions.int(), bits), (positions, bits.int()), (positions, bits[:3]), (positions[::2], bits[::2])):
        with pytest.raises(ValueError, match="contiguous int64 positions on the CPU and one 16-bit value each"):
            gather_batch(targets, modes, p, b, np.array([0, 1, 2]) if p.numel() == 2 else bounds)
    assert [t.target.tolist() for t in targets] == [list(range(10)), list(range(100, 106))]


def test_gathered_updates_take_int32_positions_strided_bits_and_other_run_tables():
    """Positions of another integer type, bits that are a strided view and a run table of
    another integer type are copied first, so the kernel reads what the caller passed, not
    neighbouring memory."""
    param = torch.arange(20, dtype=torch.int16)
    bits = torch.arange(100, 120, dtype=torch.int16)[::5]  # 100, 105, 110, 115
    positions = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    [got] = gather_updates([GatherItem(GatherTarget(param, one_run(10, 2).to(torch.int32), 10), positions, bits,
                                       "set")])
    assert got.dest.tolist() == [2, 5, 7, 11] and got.old.tolist() == [2, 5, 7, 11]
    assert got.new.tolist() == [100, 105, 110, 115]
    # a target that is the tensor (one run, from 0, at 0): the positions are the write's indices
    [got] = gather_updates([GatherItem(GatherTarget(param[2:12], one_run(10), 10), positions, bits, "set")])
    assert got.dest.dtype == torch.int64 and got.dest.tolist() == [0, 3, 5, 9]
    assert got.old.tolist() == [2, 5, 7, 11] and got.new.tolist() == [100, 105, 110, 115]
    assert gather_updates([]) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_update_from_find_changes(dtype):
    """The trainer's path: positions and XOR from find_changes (numpy), old bits gathered before
    the snapshot refresh; shard-local positions plus the shard's start give the same update."""
    old = random_tensor(dtype, (257, 31), 11)
    new = perturb({"t": old}, 0.01, 12)["t"]
    before = tensor_fingerprint(old)
    snapshot = old.clone()
    changes = find_changes(snapshot, new, update=True)
    old_bits = old.reshape(-1).view({2: torch.int16, 4: torch.int32}[old.element_size()]).numpy()
    old_bits = old_bits.view(changes.xor.dtype)[changes.positions]
    width = 8 * old.element_size()
    for backend in ("numba", "torch"):
        delta = fingerprint_delta(changes.positions, old_bits, old_bits ^ changes.xor, width, backend=backend)
        assert before + delta == tensor_fingerprint(new) == tensor_fingerprint(snapshot)
    half = old.numel() // 2
    shards = [(old.reshape(-1)[:half], new.reshape(-1)[:half], 0), (old.reshape(-1)[half:], new.reshape(-1)[half:], half)]
    total = ZERO
    for o, n, s in shards:
        c = find_changes(o.clone(), n)
        ob = o.view({2: torch.int16, 4: torch.int32}[o.element_size()]).numpy().view(c.xor.dtype)[c.positions]
        total += tensor_fingerprint(o, start=s) + fingerprint_delta(c.positions + s, ob, ob ^ c.xor, width)
    assert total == tensor_fingerprint(new)


def test_64_bit_elements_are_position_sensitive():
    """Why 64-bit elements are fingerprinted as 32-bit halves: with w = 64 the index would vanish."""
    for dtype in (torch.int64, torch.float64):
        t = random_tensor(dtype, (6,), 5)
        swapped = t[[1, 0, 2, 3, 4, 5]].contiguous()
        assert tensor_fingerprint(swapped) != tensor_fingerprint(t)
        assert tensor_fingerprint(t).hex() == ref.fingerprint_hex(t)


def test_non_contiguous_is_c_order():
    t = random_tensor(torch.bfloat16, (9, 14), 2)
    for view in (t.T, t[:, ::3], t[::2]):
        assert tensor_fingerprint(view) == tensor_fingerprint(view.contiguous())
        assert tensor_fingerprint(view, backend="torch").hex() == ref.fingerprint_hex(view)


# Computed with tests/library/fingerprint_reference.py and pinned: a change here is a format change.
KNOWN_BF16 = torch.tensor([[1.0, -2.0, float("inf"), float("nan")], [-0.0, 0.0, 1e-40, 0.015625]], dtype=torch.bfloat16)
KNOWN = {
    "bf16": (KNOWN_BF16, 0,
             "7039eb91e126ffbd0587dc2c7f5eac9d86c8c3ff357a97767aa2c5b41ffca1a6"),
    "bf16@1000": (KNOWN_BF16, 1000,
             "bdc0dbb74d2d9c70d9c25dd2348664a1f4627ea68e66a876108df38dcf5b6599"),
    "f32": (torch.arange(5, dtype=torch.float32) / 3, 0,
             "045054b1ca7c1be77966fd82f16a4200267cc7089a2e3b6a5a6c127adbe2e0fd"),
    "f16-scalar": (torch.tensor(0.5, dtype=torch.float16), 0,
             "ad8c10d9a1f98c64bea3d67abc03f5404d72183ad63a091982652885757b263c"),
    "u8": (torch.arange(250, 256, dtype=torch.uint8), 0,
             "4746f91e3a1605e1b0cab296711d3a0859a3603d4f9527fad2637ebc63d8e125"),
    "bool": (torch.tensor([True, False, True]), 0,
             "04e55b3d2994f83d5295ff01242014f975f3487604589f5f5a3f11de6272111d"),
    "i64": (torch.tensor([-1, 2**40 + 7], dtype=torch.int64), 0,
             "b4988082766854a14f5e2a3e93752017254a8e0ac8ed3a0def22f079737dd421"),
    "empty": (torch.empty(0, 4, dtype=torch.bfloat16), 0, "0" * 64),
    # the published splitmix64 output for seed 0 in lane 0: x = 0 (index 0, bits 0) gives mix(K[0])
    "u8-zero": (torch.zeros(1, dtype=torch.uint8), 0,
                "e220a8397b1dcdaf" + "".join(f"{ref.mix(k):016x}" for k in ref.K[1:])),
}
KNOWN_STATE = "cecc788b949b20be51e1aa79a2d0d606209e7606d316a399368c05ee99359a86"


@pytest.mark.parametrize("case", list(KNOWN))
def test_known_answers(case):
    t, start, expect = KNOWN[case]
    assert ref.fingerprint_hex(t, start) == expect
    got = all_backends(t, start)
    assert set(got.values()) == {expect}, got


def test_state_fingerprint_is_blake3_of_lines():
    state = {"b.weight": KNOWN["f32"][0], "a.weight": KNOWN_BF16, "s": KNOWN["f16-scalar"][0]}
    text = "".join(f"{n}\t{d}\t{s}\t{ref.fingerprint_hex(state[n])}\n"
                   for n, d, s in [("a.weight", "BF16", "2,4"), ("b.weight", "F32", "5"), ("s", "F16", "")])
    expect = blake3.blake3(text.encode()).hexdigest()
    assert expect == KNOWN_STATE
    fps = fingerprints(state)
    assert fps == fingerprints(state, backend="torch")
    entries = {n: (SAFETENSORS_DTYPES[t.dtype], t.shape, fps[n]) for n, t in state.items()}
    assert state_fingerprint(entries) == expect
    assert state_fingerprint({n: (d, s, fp.hex()) for n, (d, s, fp) in entries.items()}) == expect
    assert state_fingerprint_of(state) == state_fingerprint_of(state, backend="torch") == expect


def test_fingerprint_value_semantics():
    a = tensor_fingerprint(random_tensor(torch.float32, (50,), 1))
    b = tensor_fingerprint(random_tensor(torch.float32, (50,), 2))
    assert Fingerprint.from_hex(a.hex()) == a and str(a) == a.hex() and len(a.hex()) == 64
    assert (a + b) - b == a and a - a == ZERO and -a + a == ZERO and sum([a, b]) == a + b
    assert all(0 <= v < 2**64 for v in (a + b).lanes)
    big = Fingerprint((2**64 - 1,) * 4)
    assert (big + Fingerprint((1, 2, 3, 4))).lanes == (0, 1, 2, 3)
    assert (ZERO - Fingerprint((1, 0, 0, 0))).lanes == (2**64 - 1, 0, 0, 0)
    for bad in ("0" * 63, "0" * 64 + "0", "G" * 64, "A" * 64):
        with pytest.raises(ValueError):
            Fingerprint.from_hex(bad)
    with pytest.raises(ValueError):
        Fingerprint((0, 0, 0, 2**64))
    with pytest.raises(ValueError):
        Fingerprint((0, 0, 0))


def test_refusals():
    with pytest.raises(ValueError, match="unsupported dtype"):
        tensor_fingerprint(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match="start"):
        tensor_fingerprint(torch.zeros(3), start=-1)
    with pytest.raises(ValueError, match="16-bit"):
        fingerprint_delta(torch.tensor([0]), torch.zeros(1), torch.zeros(1), 16)
    with pytest.raises(ValueError, match="indices for"):
        fingerprint_delta(torch.tensor([0, 1]), torch.zeros(1), torch.zeros(1), 32)
    for backend in ("numba", "torch"):  # numba checks inside its kernel, torch before it starts
        with pytest.raises(ValueError, match=">= 0"):
            fingerprint_delta(np.array([3, -1]), np.zeros(2, np.uint16), np.zeros(2, np.uint16), 16, backend=backend)
    with pytest.raises(ValueError, match="numba backend"):
        tensor_fingerprint(torch.zeros(3), device="meta", backend="numba")


def test_cuda_device_selection():
    """device="cuda" runs the torch code on the GPU where there is one, and says so where not."""
    t = random_tensor(torch.bfloat16, (1000, 3), 9)
    if torch.cuda.is_available():
        assert tensor_fingerprint(t, device="cuda") == tensor_fingerprint(t.cuda()) == tensor_fingerprint(t)
    else:
        with pytest.raises(RuntimeError, match="no CUDA device"):
            tensor_fingerprint(t, device="cuda")


def test_large_tensor_many_chunks():
    """Default chunking on both backends (several numba tasks on threads, many torch passes)."""
    t = random_tensor(torch.bfloat16, (3 * (1 << 22) + 17,), 4)
    numba_fp = tensor_fingerprint(t)
    assert numba_fp == tensor_fingerprint(t, backend="torch", chunk=1 << 20)
    head = t[: 1 << 20]
    assert tensor_fingerprint(head, backend="torch") == tensor_fingerprint(head)


# --------------------------------------------------------------------------- in the format (v2)
def _drift(state: dict, frac: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in state.values():
        if t.is_floating_point():
            m = torch.rand(t.shape, generator=g) < frac
            t[m] = t[m] * 1.01


@pytest.mark.parametrize("detect", ["numba", "torch"])
def test_publisher_fingerprints_follow_the_state_in_o_changes(tmp_path, detect):
    """Every version's entries carry the fingerprint of the published tensor, though the
    publisher only ever updates them at the changed positions (dense changes and fp32 master
    weights included)."""
    from shared.chain import Chain, reconstruct
    from shared.codec import entries_fingerprint
    from shared.fingerprint import state_fingerprint_of
    from shared.publisher import DeltaPublisher
    from shared.stores import open_store

    torch.manual_seed(1)
    state = {"a.weight": torch.randn(64, 96) * 0.02, "b.weight": (torch.randn(300) * 0.02).bfloat16(),
             "steps": torch.zeros(3, dtype=torch.int64)}
    with DeltaPublisher(state, str(tmp_path), detect=detect) as pub:
        for v, frac in enumerate([0.01, 0.02, 0.7, 0.0, 0.01], start=1):
            _drift(state, frac, v)
            state["steps"][0] = v
            pub.publish()
    chain = Chain(open_store(str(tmp_path)))
    for v in range(6):
        st, header = reconstruct(chain, v)
        assert header.state_fingerprint == entries_fingerprint(header.tensors) == state_fingerprint_of(st)
    published = {n: (t.bfloat16() if t.is_floating_point() else t) for n, t in state.items()}
    assert header.state_fingerprint == state_fingerprint_of(published)


def test_formats_1_and_2_are_refused_by_name_and_fingerprints_are_checked(tmp_path):
    import blake3
    import safetensors.torch

    from shared.codec import FORMAT_VERSION, DeltaFile, anchor_header, save_anchor
    from shared.errors import DeltaError

    state = {"w": torch.arange(12, dtype=torch.float32).bfloat16()}
    header = anchor_header(state, version=0)
    path = tmp_path / "a.safetensors"
    save_anchor(state, path, header)
    assert DeltaFile.open(path).header.state_fingerprint == header.state_fingerprint

    def rewrite(doc: dict) -> None:
        text = json.dumps(doc)
        safetensors.torch.save_file(state, str(path), metadata={
            "format": "deltasync", "deltasync": text, "deltasync_blake3": blake3.blake3(text.encode()).hexdigest()})

    doc = json.loads(header.model_dump_json(exclude_defaults=True))
    rewrite(doc)  # formats 1 and 2 left their version out (it was the default)
    with pytest.raises(DeltaError, match="format version 1 or 2 .commitments over blake3") as e:
        DeltaFile.open(path)
    assert e.value.reason == "format"
    rewrite({"format_version": 99, **doc})
    with pytest.raises(DeltaError, match="format version 99 is not supported .this deltasync reads 3, 4.") as e:
        DeltaFile.open(path)
    assert e.value.reason == "format"
    doc = {"format_version": FORMAT_VERSION, **doc}
    doc["tensors"]["w"]["fingerprint"] = "0" * 64
    rewrite(doc)
    with pytest.raises(DeltaError, match="fingerprints do not add up") as e:
        DeltaFile.open(path)
    assert e.value.reason == "corrupt"


@pytest.mark.parametrize("field, text, reason", [
    ("fingerprint", "AB" * 32, "fingerprints do not add up"),  # upper case
    ("fingerprint", "ab" * 31 + "a", "fingerprints do not add up"),  # 63 digits
    ("fingerprint", "ab" * 32 + "ab", "fingerprints do not add up"),  # 66 digits
    ("digest", "0g" * 32, "digests do not add up"),
    ("digest", "ab" * 31, "digests do not add up")])
def test_header_refuses_a_malformed_hash_even_where_its_sums_are_recomputed(tmp_path, field, text, reason):
    """Every tensor's digest ("" or 64 lowercase hex digits) and fingerprint (64 of them) is
    checked, not only what they add up to: a header forged with its state digest, state
    fingerprint and commitment recomputed over a malformed entry is still refused."""
    import blake3
    import safetensors.torch

    from shared.codec import FORMAT_VERSION, DeltaFile, anchor_header, chain_commitment, entries_digest, entries_fingerprint
    from shared.errors import DeltaError

    state = {"w": torch.arange(12, dtype=torch.float32).bfloat16(), "v": torch.ones(3).bfloat16()}
    header = anchor_header(state, version=0)
    setattr(header.tensors["w"], field, text)
    header.state_digest = entries_digest(header.tensors)
    header.state_fingerprint = entries_fingerprint(header.tensors)
    header.commitment = chain_commitment(header.base_commitment, [header.state_fingerprint])
    body = header.model_dump_json(exclude_defaults=True)
    text = f'{{"format_version":{FORMAT_VERSION},{body[1:]}'
    path = tmp_path / "a.safetensors"
    safetensors.torch.save_file(state, str(path), metadata={
        "format": "deltasync", "deltasync": text, "deltasync_blake3": blake3.blake3(text.encode()).hexdigest()})
    with pytest.raises(DeltaError, match=reason) as e:
        DeltaFile.open(path)
    assert e.value.reason == "corrupt"
