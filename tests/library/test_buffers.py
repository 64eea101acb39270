"""Kept working arrays: handed out again only once nothing refers to them, and decoding into
them never touches the arrays of a version still held (its patches revert exactly)."""

from __future__ import annotations

import threading

import numpy as np
import torch

from shared import buffers
from shared.apply import prepare, write_all
from shared.codec import DeltaFile, anchor_header, encode_delta

from .helpers import same_bits

LARGE = buffers.KEEP_FROM // 8 + 1  # int64 elements: just over the size worth keeping


def span(a: np.ndarray) -> tuple[int, int]:
    return a.ctypes.data, a.ctypes.data + a.nbytes


def test_a_buffer_is_reused_only_once_every_array_and_tensor_made_from_it_is_gone():
    first = buffers.empty(LARGE, np.int64)
    where = first.ctypes.data
    tensor = torch.from_numpy(first[5:].view(np.uint32))  # a view of a view, then a tensor
    del first
    second = buffers.empty(LARGE, np.int64)
    lo, hi = span(second)
    assert hi <= where or lo >= where + LARGE * 8  # still in use through the tensor: elsewhere
    second[:] = -1
    tensor.fill_(7)
    assert (second == -1).all() and bool((tensor == 7).all())
    del tensor, second
    again = [buffers.empty(LARGE, np.int64) for _ in range(2)]
    assert where in {a.ctypes.data for a in again}


def test_small_arrays_are_not_kept():
    before = buffers.kept_bytes()
    small = buffers.empty(1000, np.int16)
    assert small.shape == (1000,) and small.dtype == np.int16
    assert buffers.kept_bytes() == before


def test_threads_never_share_a_buffer():
    rounds, workers = 20, 4
    barrier = threading.Barrier(workers)
    held: list[list[np.ndarray]] = [[] for _ in range(workers)]

    def take(k: int) -> None:
        for _ in range(rounds):
            barrier.wait()
            a = buffers.empty(LARGE + k, np.int64)
            a[:] = k
            held[k].append(a)
            barrier.wait()
            assert (a == k).all()
            if len(held[k]) > 2:
                held[k].pop(0)  # some arrays go, some stay: a mix of free and used buffers

    threads = [threading.Thread(target=take, args=(k,)) for k in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans = sorted(span(a) for arrays in held for a in arrays)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two live arrays overlap
    assert all((a == k).all() for k, arrays in enumerate(held) for a in arrays)


def one_ulp_steps(state: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """A copy where ``fraction`` of each tensor's elements move by one ulp (Adam-like changes,
    coded with Rice positions and rANS values: the batched decode into kept buffers)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        bits = t.clone().view(torch.int16).reshape(-1)
        mask = torch.rand(bits.numel(), generator=g) < fraction
        bits[mask] += torch.where(torch.rand(int(mask.sum()), generator=g) < 0.5, 1, -1).to(torch.int16)
        out[name] = bits.view(torch.bfloat16).reshape(t.shape)
    return out


def test_a_held_version_reverts_exactly_after_the_next_decodes_into_kept_buffers():
    g = torch.Generator().manual_seed(3)
    base = {f"w{i}": (torch.randn(1 << 20, generator=g) * 0.02).to(torch.bfloat16) for i in range(2)}
    v1 = one_ulp_steps(base, 0.2, 1)
    v2 = one_ulp_steps(v1, 0.2, 2)
    h0 = anchor_header(base, version=0)
    d1 = DeltaFile.from_bytes(encode_delta(base, v1, version=1, base_version=0, base_commitment=h0.commitment))
    d2 = DeltaFile.from_bytes(encode_delta(v1, v2, version=2, base_version=1, base_commitment=""))
    assert min(e.changed for e in d1.header.tensors.values()) * 8 >= buffers.KEEP_FROM
    target = {n: t.clone() for n, t in base.items()}

    first = prepare(d1, target)
    write_all(first)
    assert same_bits(target, v1)
    used = {p.positions.data_ptr() for p in first}
    second = prepare(d2, target)  # the first version's patches are still held
    assert used.isdisjoint(p.positions.data_ptr() for p in second)
    write_all(second)
    assert same_bits(target, v2)
    for p in reversed(second):
        p.revert()
    assert same_bits(target, v1)
    for p in reversed(first):
        p.revert()
    assert same_bits(target, base)

    del first, p
    third = prepare(d1, target)  # the first version's buffers are free again: decoded into them
    assert used & {p.positions.data_ptr() for p in third}
    write_all(third)
    assert same_bits(target, v1)
