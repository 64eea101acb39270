"""Damaged input is refused with a clear reason and changes nothing."""

from __future__ import annotations

import random

import pytest
import torch

from shared.apply import apply_delta
from shared.codec import DeltaFile, anchor_header, encode_delta
from shared.errors import DeltaError

from .helpers import perturb, same_bits


@pytest.fixture(scope="module")
def chain3():
    torch.manual_seed(0)
    s0 = {"w": (torch.randn(64, 128) * 0.02).bfloat16(), "n": torch.ones(128), "i": torch.arange(4)}
    s1 = perturb(s0, 0.02, 1)
    s2 = perturb(s1, 0.02, 2)
    c0 = anchor_header(s0, version=0).commitment
    d1 = encode_delta(s0, s1, version=1, base_version=0, base_commitment=c0)
    c1 = DeltaFile.from_bytes(d1).header.commitment
    d2 = encode_delta(s1, s2, version=2, base_version=1, base_commitment=c1)
    return s0, s1, s2, c0, c1, d1, d2


def refused(data: bytes, target, **where) -> DeltaError:
    before = {n: t.clone() for n, t in target.items()}
    with pytest.raises(DeltaError) as e:
        apply_delta(DeltaFile.from_bytes(data), target, **where)
    assert same_bits(target, before), "a refused delta changed the target"
    assert str(e.value).startswith(e.value.reason)
    return e.value


def test_every_sampled_bit_flip_is_refused(chain3):
    s0, _, _, c0, _, d1, _ = chain3
    rng = random.Random(0)
    positions = sorted(set(rng.randrange(len(d1)) for _ in range(300)) | set(range(0, 16)))
    reasons = set()
    for i in positions:
        bad = bytearray(d1)
        bad[i] ^= 1 << rng.randrange(8)
        reasons.add(refused(bytes(bad), {n: t.clone() for n, t in s0.items()},
                            version=0, commitment=c0).reason)
    assert reasons <= {"format", "corrupt"}


@pytest.mark.parametrize("cut", [0, 4, 8, 100, -1, -50])
def test_truncation_is_refused(chain3, cut):
    s0, _, _, c0, _, d1, _ = chain3
    data = d1[:cut] if cut >= 0 else d1[:len(d1) + cut]
    e = refused(data, {n: t.clone() for n, t in s0.items()}, version=0, commitment=c0)
    assert e.reason in {"format", "corrupt"}


def test_wrong_base_and_out_of_order(chain3):
    s0, s1, _, c0, c1, d1, d2 = chain3
    e = refused(d2, {n: t.clone() for n, t in s0.items()}, version=0, commitment=c0)
    assert e.reason == "wrong_base"
    e = refused(d2, {n: t.clone() for n, t in s1.items()}, version=0, commitment=c1)
    assert e.reason == "out_of_order"
    # a plain checkpoint, known only by its state digest
    from shared.digest import state_digest

    e = refused(d2, {n: t.clone() for n, t in s0.items()}, state_digest=state_digest(s0))
    assert e.reason == "wrong_base"


def test_xor_is_never_applied_twice(chain3):
    s0, s1, _, c0, c1, d1, _ = chain3
    target = {n: t.clone() for n, t in s0.items()}
    apply_delta(DeltaFile.from_bytes(d1), target, version=0, commitment=c0)
    assert same_bits(target, s1)
    e = refused(d1, target, version=1, commitment=c1)
    assert e.reason == "wrong_base"


def test_bad_header_and_not_deltasync(chain3, tmp_path):
    import safetensors.torch

    with pytest.raises(DeltaError) as e:
        DeltaFile.from_bytes(b"\xff" * 64)
    assert e.value.reason == "format"
    plain = safetensors.torch.save({"w": torch.zeros(3)})
    with pytest.raises(DeltaError) as e:
        DeltaFile.from_bytes(plain)
    assert e.value.reason == "format"


def test_target_mismatch_is_refused(chain3):
    s0, _, _, c0, _, d1, _ = chain3
    target = {n: t.clone() for n, t in s0.items()}
    target["w"] = target["w"][:32].clone()
    e = refused(d1, target, version=0, commitment=c0)
    assert e.reason == "shape_mismatch"


def test_failure_mid_apply_rolls_back(chain3, monkeypatch):
    """A digest mismatch after writing (a bug or a bad engine) reverts every tensor."""
    s0, _, _, c0, _, d1, _ = chain3
    import shared.apply as ap

    real = ap.holds
    monkeypatch.setattr(ap, "holds", lambda entry, t: t.dtype != torch.float32 and real(entry, t))
    target = {n: t.clone() for n, t in s0.items()}
    e = refused(d1, target, version=0, commitment=c0)
    assert e.reason == "digest_mismatch"


def test_values_wider_than_their_element_are_refused():
    """A value blob that decodes to values wider than the tensor's elements (an encoder's bug, or
    a blob swapped in under a payload digest that matches it) is refused by name, in the decoding
    of a whole delta (positions and values in one loop) and of a blob alone, and nothing changes."""
    import numpy as np

    from shared.codec import POS, VAL, build_delta, encode_state, save_delta
    from shared.entropy import decode_ints_into, encode_ints

    torch.manual_seed(0)
    base = {"w": (torch.randn(64, 128) * 0.02).bfloat16()}
    bits = base["w"].view(torch.int16).clone()
    at = torch.randperm(bits.numel(), generator=torch.Generator().manual_seed(0))[:160]
    bits.view(-1)[at] ^= 1  # one-ulp moves at random places: values entropy-coded, positions Rice-coded
    encoded = encode_state(base, {"w": bits.view(torch.bfloat16)})
    entry = encoded["w"].entry
    assert entry.coders == {VAL: "ans", POS: "rice"}  # the fused decoding's case
    wide = np.full(entry.changed, 1 << 17, dtype=np.uint64)  # 18 bits, for 16-bit elements
    encoded["w"].blobs["w" + VAL] = torch.frombuffer(bytearray(encode_ints(wide)), dtype=torch.uint8)
    c0 = anchor_header(base, version=0).commitment
    header, tensors = build_delta(encoded, version=1, base_version=0, base_commitment=c0)
    e = refused(save_delta(header, tensors), {n: t.clone() for n, t in base.items()}, version=0, commitment=c0)
    assert e.reason == "corrupt" and "w: entropy-coded blob: value wider than its element" in str(e)
    with pytest.raises(DeltaError, match="value wider than its element"):
        decode_ints_into(encode_ints(wide), np.empty(len(wide), np.uint16))
