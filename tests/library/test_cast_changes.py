"""The fused fp32->bf16 cast in change detection (``find_cast_changes``) must give exactly what
torch's cast followed by ``find_changes`` gives: it decides which bits a replica receives."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.changes import find_cast_changes, find_changes

# bit patterns that stress rounding: ties (low half exactly 0x8000) on even and odd bf16 mantissas,
# one above and below a tie, the largest finite values (round to infinity), zeros, infinities
SPECIAL = [0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000,
           0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x00800000, 0x80800000]


def _fp32(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.astype(np.uint32).view(np.int32)).view(torch.float32)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 5000), special=st.floats(0, 0.5),
       changed=st.floats(0, 0.2))
def test_fused_cast_equals_torch_cast_then_compare(seed: int, n: int, special: float, changed: float):
    rng = np.random.default_rng(seed)
    bits = rng.integers(0x00800000, 0x7F7FFFFF, n, dtype=np.uint32) | (rng.integers(0, 2, n, dtype=np.uint32) << 31)
    pick = rng.random(n) < special
    bits[pick] = rng.choice(np.array(SPECIAL, dtype=np.uint32), int(pick.sum()))
    live = _fp32(bits)
    old = live.to(torch.bfloat16)
    flip = rng.random(n) < changed  # the step: some weights move
    live[flip] = live[flip] * torch.from_numpy(rng.uniform(0.99, 1.01, int(flip.sum())).astype(np.float32))

    fused_old, torch_old = old.clone(), old.clone()
    fused = find_cast_changes(fused_old, live, update=True)
    expect = find_changes(torch_old, live.to(torch.bfloat16), update=True)
    if fused is False:  # only for NaN or subnormal weights (a step can make the smallest normal subnormal)
        u = live.view(torch.int32).numpy().view(np.uint32)
        exp, man = u & 0x7F800000, u & 0x007FFFFF
        assert (((exp == 0x7F800000) | (exp == 0)) & (man != 0)).any()
        assert torch.equal(fused_old.view(torch.int16), old.view(torch.int16))  # the refresh taken back
        return
    if expect is None:
        assert fused is None
        assert torch.equal(fused_old.view(torch.int16), old.view(torch.int16))
        return
    assert np.array_equal(fused.positions, expect.positions)
    assert np.array_equal(fused.xor, expect.xor)
    assert np.array_equal(fused.new, expect.new) and fused.new.dtype == np.uint16  # the cast bits
    assert torch.equal(fused_old.view(torch.int16), torch_old.view(torch.int16))


def test_nan_and_subnormal_weights_fall_back_to_torch():
    old = torch.zeros(4, dtype=torch.bfloat16)
    for bits in (0x7FC00000, 0x00000001):
        live = _fp32(np.array([0x3F800000, bits, 0, 0], dtype=np.uint32))
        assert find_cast_changes(old.clone(), live) is False


def test_a_refusing_chunk_takes_back_the_earlier_chunks_refresh():
    """The refresh runs inside the scan: when a later chunk holds a NaN (or changes densely),
    the chunks already scanned and refreshed are put back, so nothing is half-updated."""
    from shared.changes import CHUNK_ELEMENTS

    n = CHUNK_ELEMENTS + 1000
    live = torch.full((n,), 1.0, dtype=torch.float32)
    old = live.to(torch.bfloat16)
    live[:100] = 2.0  # first chunk: sparse, refreshed as it is scanned
    for tail, expect in ((float("nan"), False), (3.0, None)):
        step = live.clone()
        step[CHUNK_ELEMENTS + 10:] = tail  # second chunk: a NaN, or every element changed
        snap = old.clone()
        assert find_cast_changes(snap, step, update=True) is expect
        assert torch.equal(snap.view(torch.int16), old.view(torch.int16))
    snap = old.clone()
    found = find_cast_changes(snap, live, update=True)
    assert found.positions.tolist() == list(range(100))
    assert torch.equal(snap.view(torch.int16), live.to(torch.bfloat16).view(torch.int16))
