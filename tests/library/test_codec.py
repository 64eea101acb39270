"""Round trips of the codec: exact to the bit for every dtype, shape, density and special value."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from shared import apply as apply_module
from shared.apply import apply_delta
from shared.codec import DeltaFile, anchor_header, decode_positions, encode_delta, encode_positions
from shared.digest import state_digest
from shared.errors import DeltaError
from shared.squash import NotSquashable, squash, squash_onto

from .helpers import bits_state, perturb, same_bits

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8]
SHAPES = [(), (0,), (0, 3), (1,), (3,), (7, 5), (130,), (3, 1, 17), (1024,)]

specs = st.dictionaries(
    st.text("abcxyz.", min_size=1, max_size=6),
    st.tuples(st.sampled_from(SHAPES), st.sampled_from(DTYPES)),
    min_size=1, max_size=4,
)


def roundtrip(base, new, compact=False):
    h0 = anchor_header(base, version=0)
    data = encode_delta(base, new, version=1, base_version=0, base_commitment=h0.commitment,
                        compact=compact)
    delta = DeltaFile.from_bytes(data)
    target = {n: t.clone() for n, t in base.items()}
    header = apply_delta(delta, target, version=0, commitment=h0.commitment)
    return data, header, target


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=specs, fraction=st.sampled_from([0.0, 0.001, 0.01, 0.1, 0.5, 1.0]),
       seed=st.integers(0, 2**16), compact=st.booleans())
def test_roundtrip_is_bit_exact(specs, fraction, seed, compact):
    base = bits_state(seed, specs)
    new = perturb(base, fraction, seed + 1)
    data, header, target = roundtrip(base, new, compact)
    assert same_bits(target, new)
    assert header.state_digest == state_digest(new)
    assert header.changed == sum(
        int((a.reshape(-1).view(torch.uint8).view(-1, a.element_size())
             != b.reshape(-1).view(torch.uint8).view(-1, b.element_size())).any(1).sum())
        for a, b in ((base[n], new[n]) for n in base) if a.numel())


@pytest.mark.parametrize("threads_from", [0, 1 << 62], ids=["threads", "serial"])
def test_apply_on_the_tensor_threads_or_serially_is_the_same(monkeypatch, threads_from):
    """Small deltas decode on the calling thread, large ones on the tensor threads: both exact."""
    monkeypatch.setattr(apply_module, "THREADS_FROM_CHANGES", threads_from)
    shapes = {f"t{i}": ((64, 33), dtype) for i, dtype in enumerate(DTYPES * 2)}
    base = bits_state(7, shapes)
    new = perturb(base, 0.05, 8)
    _, header, target = roundtrip(base, new)
    assert same_bits(target, new)
    assert header.state_digest == state_digest(new)


def test_special_values_survive():
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-45, 3.0])
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        base = {"w": torch.zeros(8, dtype=dtype)}
        new = {"w": specials.to(dtype)}
        # a NaN with a custom payload, which value comparisons would never see
        new["w"].view(torch.int16 if dtype != torch.float32 else torch.int32)[0] |= 0x3
        _, _, target = roundtrip(base, new)
        assert same_bits(target, new)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 2**40), max_size=300, unique=True))
def test_positions_roundtrip(values):
    pos = np.array(sorted(values), dtype=np.int64)
    blob, nbytes, coder = encode_positions(pos)
    out = decode_positions(blob, len(pos), nbytes, 2**41, coder)
    assert np.array_equal(out, pos)


def _structured_positions(kind: str, rng: np.random.Generator) -> np.ndarray:
    if kind == "runs":  # blocks of neighbours, as rows of an embedding
        starts = np.sort(rng.choice(10**5, 40, replace=False)) * 64
        return (starts[:, None] + np.arange(50)).ravel()
    if kind == "stride":  # one column of a row-major matrix
        return np.arange(300) * 1024 + 7
    rows = 5 if kind == "columns-long" else 96  # the same columns in every row
    cols = np.sort(rng.choice(4096, {"columns": 40, "columns-long": 450}[kind], replace=False))
    return (np.arange(rows)[:, None] * 4096 + cols).ravel()


@pytest.mark.parametrize("kind", ["runs", "stride", "columns", "columns-long"])
def test_structured_positions_are_tried_with_zstd_and_it_wins(kind):
    """The zstd trial of positions is skipped only where the gaps look like independent
    changes; runs, strides and a repeating column pattern keep it, and it is far smaller."""
    from shared.codec import _gap_planes
    from shared.entropy import rice_encode

    pos = _structured_positions(kind, np.random.default_rng(0)).astype(np.int64)
    blob, nbytes, coder = encode_positions(pos)
    assert coder == "zstd" and len(blob) == len(_gap_planes(pos)[0]) < len(rice_encode(pos, running=True)) / 4
    assert np.array_equal(decode_positions(blob, len(pos), nbytes, int(pos[-1]) + 1, coder), pos)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 6000), density=st.sampled_from([1e-4, 1e-3, 1e-2, 0.05, 0.3]), seed=st.integers(0, 2**16))
def test_positions_go_as_the_smaller_coding_where_changes_are_independent(n, density, seed):
    """Where the trial is skipped, it would not have won: independent positions at any density."""
    from shared.codec import SAMPLE, _gap_planes
    from shared.entropy import rice_encode

    numel = max(int(n / density), n)
    pos = np.sort(np.random.default_rng(seed).choice(numel, n, replace=False)).astype(np.int64)
    blob, _, coder = encode_positions(pos)
    rice, zstd = rice_encode(pos, running=True), _gap_planes(pos)[0]
    assert blob == {"rice": rice, "zstd": zstd}[coder]
    if n <= SAMPLE:  # decided on every change: the smaller one
        assert len(blob) == min(len(rice), len(zstd))


def test_value_kind_estimates_follow_their_definitions():
    """``value_kind_sizes`` (one pass) against the definitions in plain numpy: the entropy-coded
    size of the XORs and of the zigzagged wrapping differences, and the byte planes' entropy."""
    from shared.entropy import ALPHABET
    from shared.kernels import value_kind_sizes

    def ints_bytes(v: np.ndarray) -> float:
        v = v.astype(np.uint64)
        small = v < 16
        length = np.where(small, 0, np.floor(np.log2(np.maximum(v, 1).astype(np.float64))).astype(np.int64) + 1)
        second = np.where(small, 0, (v >> np.maximum(length - 2, 0).astype(np.uint64)) & np.uint64(1))
        sym = np.where(small, v, 16 + 2 * (length - 5) + second)
        raw = np.where(small, 0, length - 2).sum()
        _, counts = np.unique(sym, return_counts=True)
        p = counts / max(len(v), 1)
        return (-(p * np.log2(p)).sum() * len(v) + raw) / 8 + 12 + 3 * len(counts)

    def planes_bytes(v: np.ndarray) -> float:
        b = v.view(np.uint8).reshape(len(v), v.itemsize)
        total = 0.0
        for plane in b.T:
            _, c = np.unique(plane, return_counts=True)
            total -= (c * np.log2(c / len(v))).sum()
        return total / 8

    rng = np.random.default_rng(1)
    for dtype, signed in ((np.uint16, np.int16), (np.uint32, np.int32)):
        for n in (1, 7, 1000, 4096):
            new = rng.integers(0, np.iinfo(dtype).max, n, dtype=dtype, endpoint=True)
            old = (new.astype(np.int64) + rng.integers(-3, 4, n)).astype(dtype)
            xor, add = old ^ new, (new - old).view(signed).astype(np.int64)
            out = np.empty(3)
            value_kind_sizes(xor, new, min(n, 1024), ALPHABET, out)
            want = [ints_bytes(xor), ints_bytes((add << 1) ^ (add >> 63)), planes_bytes(new[:1024])]
            assert np.allclose(out, want, rtol=1e-12, atol=0), (dtype, n, out, want)


def test_payload_is_small_at_one_percent():
    """At ~1% change on LLM-like bf16 weights the delta is far below int32+bf16 (6 B/change)."""
    torch.manual_seed(0)
    base = {"w": (torch.randn(512, 1024) * 0.02).bfloat16()}
    new = {"w": base["w"].clone()}
    m = torch.rand(base["w"].shape) < 0.01
    new["w"][m] = (new["w"][m].float() * (1 + 2**-8)).bfloat16()  # one-ulp moves
    data, header, target = roundtrip(base, new)
    assert same_bits(target, new)
    assert len(data) / header.changed < 1.5
    assert header.tensors["w"].encoding == "add"


@pytest.mark.parametrize("changed", [100, 10_000])
def test_values_set_to_one_constant_are_sent_as_set(changed):
    """Weights reset to one value (a pruned or re-initialised slice) differ from their old bits
    in every way, but their new bits repeat: the "set" kind's zstd trial is not skipped by the
    entropy gate in front of it, and wins."""
    torch.manual_seed(0)
    base = {"w": (torch.randn(256, 1024) * 0.02).bfloat16()}
    new = {"w": base["w"].clone()}
    new["w"].view(-1)[torch.randperm(new["w"].numel())[:changed]] = 0.5
    data, header, target = roundtrip(base, new)
    assert same_bits(target, new)
    assert header.tensors["w"].encoding == "set"


def test_compact_positions_follow_the_base_exponent():
    """When small weights change more often (as when a step is below one ulp of large ones),
    coding positions per exponent class is smaller, and it needs the base to decode."""
    torch.manual_seed(0)
    base = {"w": (torch.randn(512, 1024) * 0.02).bfloat16()}
    w = base["w"].float()
    p = (3e-7 / (w.abs() * 2**-8 + 1e-12)).clamp(max=1)  # one-ulp steps of a fixed size
    m = torch.rand(w.shape) < p
    new = {"w": base["w"].clone()}
    new["w"][m] = (w[m] + w[m].abs() * 2**-7).bfloat16()
    plain, _, _ = roundtrip(base, new)
    compact, header, target = roundtrip(base, new, compact=True)
    assert same_bits(target, new) and header.tensors["w"].positions == "classed"
    assert len(compact) < 0.95 * len(plain)
    
    with pytest.raises(DeltaError, match="base"):
        DeltaFile.from_bytes(compact).change("w")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=specs, seed=st.integers(0, 2**16), steps=st.integers(1, 4),
       fraction=st.sampled_from([0.01, 0.2, 0.9]))
def test_squash_equals_sequential(specs, seed, steps, fraction):
    states = [bits_state(seed, specs)]
    for i in range(steps):
        states.append(perturb(states[-1], fraction, seed + 10 + i))
    c = anchor_header(states[0], version=0).commitment
    files = []
    for i in range(1, steps + 1):
        f = DeltaFile.from_bytes(encode_delta(states[i - 1], states[i], version=i, base_version=i - 1,
                                              base_commitment=c))
        files.append(f)
        c = f.header.commitment
    squashed = [squash_onto(states[0], files)]
    try:
        squashed.append(squash(files))  # without the base: not every mix of kinds composes
    except NotSquashable:
        assert len({f.header.tensors[n].encoding for f in files for n in specs} - {"same", "full"}) > 1
    for data in squashed:
        sq = DeltaFile.from_bytes(data)
        assert sq.header.commitment == files[-1].header.commitment
        target = {n: t.clone() for n, t in states[0].items()}
        apply_delta(sq, target, version=0, commitment=anchor_header(states[0], version=0).commitment)
        assert same_bits(target, states[-1])
    assert DeltaFile.from_bytes(squashed[0]).size <= sum(f.size for f in files) + 2048 * len(specs)


def test_module_target_with_tied_weights(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from shared.checkpoint import load_state, module_state

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    state = module_state(model)
    assert "lm_head.weight" not in state  # tied: once, under the embedding's name
    assert set(state) == set(load_state(tiny_model_dir))
    new = perturb({n: t.clone() for n, t in state.items()}, 0.01, 3)
    h0 = anchor_header(state, version=0)
    delta = DeltaFile.from_bytes(encode_delta(state, new, version=1, base_version=0,
                                              base_commitment=h0.commitment))
    apply_delta(delta, model, version=0, commitment=h0.commitment)
    assert same_bits(module_state(model), new)
    assert torch.equal(model.lm_head.weight.view(torch.int16), new["model.embed_tokens.weight"].view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_find_changes_overflow_leaves_snapshot(dtype):
    from shared.changes import find_changes

    old = torch.zeros(1000, dtype=dtype)
    new = torch.ones(1000, dtype=dtype)
    assert find_changes(old, new, update=True) is None
    assert torch.count_nonzero(old) == 0  # dense change: nothing half-updated
    new2 = old.clone()
    new2[[3, 999]] = 1
    ch = find_changes(old, new2, update=True)
    assert ch.positions.tolist() == [3, 999]
    assert torch.equal(old, new2)
    # the cap (here 1) is passed inside one block: its first change recorded, then taken back
    few = torch.arange(8, dtype=dtype)
    new3 = few.clone()
    new3[[0, 1]] = 100
    assert find_changes(old := few.clone(), new3, update=True, max_fraction=0.01, threads=False) is None
    assert torch.equal(old, few)


@pytest.mark.parametrize("share", [0.1, 0.45, 0.55, 1.0])
def test_a_change_over_the_scans_cap_keeps_its_positions_up_to_half_the_elements(share):
    """Past 1/16 of a chunk the scan gives up and one pass takes the XOR of every element; the
    positions are still coded from it (fast to decode) unless more than half changed, and the
    delta rebuilds the new bits exactly either way."""
    from shared.codec import encode_tensor

    g = torch.Generator().manual_seed(3)
    base = (torch.randn(40_000, generator=g) * 0.02).to(torch.bfloat16)
    new = base.clone()
    at = torch.randperm(base.numel(), generator=g)[:int(base.numel() * share)]
    new.view(torch.int16)[at] += 1  # one ulp up
    enc = encode_tensor("t", base.clone(), new, digest="")
    assert enc.entry.changed == at.numel()
    assert enc.entry.positions == ("gaps" if share < 0.5 else "all")
    assert ("t::pos" in enc.blobs) == (share < 0.5)
    delta = DeltaFile.from_bytes(encode_delta({"t": base}, {"t": new}, version=1, base_version=0, base_commitment=""))
    assert delta.header.tensors["t"].positions == enc.entry.positions
    target = {"t": base.clone()}
    apply_delta(delta, target)
    assert torch.equal(target["t"].view(torch.int16), new.view(torch.int16))


@pytest.mark.parametrize("threads", [False, True])
def test_find_changes_dense_chunk_takes_back_the_other_chunks_refresh(threads):
    """The refresh is fused into the scan: a sparse chunk refreshed before (or beside) a chunk
    that turns out dense is put back, and a dense chunk that had begun refreshing puts itself
    back, so a None never half-updates."""
    from shared.changes import CHUNK_ELEMENTS, find_changes

    n = 2 * CHUNK_ELEMENTS + 13  # three chunks, the last with a tail of single elements
    base = torch.arange(n, dtype=torch.int32).to(torch.bfloat16)
    new = base.clone()
    new[[0, 5, CHUNK_ELEMENTS - 1]] = 7  # chunk 0: sparse
    new[2 * CHUNK_ELEMENTS:] = -1  # chunk 2: every element changed
    old = base.clone()
    assert find_changes(old, new, update=True, threads=threads) is None
    assert torch.equal(old.view(torch.int16), base.view(torch.int16))
    new[2 * CHUNK_ELEMENTS:] = base[2 * CHUNK_ELEMENTS:]
    new[n - 1] = 9  # the tail's last element
    ch = find_changes(old, new, update=True, threads=threads)
    expect = torch.nonzero(base.view(torch.int16) != new.view(torch.int16)).reshape(-1)
    assert ch.positions.tolist() == expect.tolist()
    assert torch.equal(old.view(torch.int16), new.view(torch.int16))


@settings(max_examples=80, deadline=None)
@given(numel=st.integers(0, 700), dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       fraction=st.sampled_from([0.01, 0.1, 0.3]), slack=st.integers(-3, 3), seed=st.integers(0, 2**16),
       update=st.booleans())
def test_find_changes_agrees_with_a_plain_compare_at_the_dense_boundary(numel, dtype, fraction, slack, seed,
                                                                        update):
    """Whole blocks of 64 elements and the partial block after them count the same: the result
    is None exactly when more than the chunk's cap changed, and a None leaves the snapshot as it
    was."""
    from shared.changes import find_changes

    g = torch.Generator().manual_seed(seed)
    cap = int(numel * fraction) + 1
    count = max(0, min(numel, cap + slack))
    base = torch.randn(numel, generator=g).to(dtype)
    new = base.clone()
    where = torch.randperm(numel, generator=g)[:count]
    bits = new.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
    bits[where] ^= 1 << (seed % 15)
    old = base.clone()
    found = find_changes(old, new, update=update, max_fraction=fraction, threads=False)
    if count > cap:
        assert found is None
        assert torch.equal(old.view(bits.dtype), base.view(bits.dtype))
        return
    assert found.positions.tolist() == sorted(where.tolist())
    expect_xor = base.view(bits.dtype)[found.positions] ^ bits[found.positions]
    assert found.xor.astype(np.int64).tolist() == (expect_xor.numpy().astype(np.int64)
                                                    & (2 ** (8 * base.element_size()) - 1)).tolist()
    assert found.new.tobytes() == bits[found.positions].numpy().tobytes()  # the scan's new bits
    assert torch.equal(old.view(bits.dtype), (new if update else base).view(bits.dtype))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 40), st.integers(0, 2**64 - 1)), max_size=400))
@example([2**53 + 1, 2**64 - 1, 3])  # above float64's integers: a kernel once rounded them
def test_entropy_coders_roundtrip_and_refuse_truncation(values):
    from shared.entropy import decode_ints, encode_ints, rice_decode, rice_encode
    from shared.errors import DeltaError

    x = np.array(values, dtype=np.uint64)
    for enc, dec in ((encode_ints, decode_ints), (rice_encode, rice_decode)):
        blob = enc(x)
        assert np.array_equal(dec(blob, len(x)), x)
        if len(x) and len(blob) > 16:
            with pytest.raises(DeltaError):
                dec(blob[: len(blob) // 2], len(x))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 2**40), min_size=1, max_size=300, unique=True))
def test_rice_positions_are_checked_in_the_decoding_pass(positions):
    """Running positions decode strictly increasing and below the tensor's size, or are refused
    by name; there is no second pass to catch them."""
    from shared.entropy import rice_decode, rice_encode
    from shared.errors import DeltaError

    x = np.array(sorted(positions), dtype=np.int64)
    blob = rice_encode(x, running=True)
    assert np.array_equal(rice_decode(blob, len(x), running=True, limit=int(x[-1]) + 1), x)
    with pytest.raises(DeltaError, match=f"outside a tensor of {int(x[-1])} elements"):
        rice_decode(blob, len(x), running=True, limit=int(x[-1]))
    # a gap near 2**64 (an escaped value) must not wrap around into the tensor
    wrapped = rice_encode(np.array([5, 2**64 - 3], dtype=np.uint64))
    with pytest.raises(DeltaError, match="outside a tensor"):
        rice_decode(wrapped, 2, running=True, limit=1 << 40)


@pytest.mark.parametrize("tables", ["gamma", "zstd"])
def test_entropy_table_that_does_not_add_up_is_refused(tables):
    """In either table coding (format 4's own, format 3's zstd frame), frequencies that do not
    add up to 2**12 are refused before any symbol is decoded."""
    from shared.entropy import _HEAD, ALPHABET, decode_ints, encode_ints, zstd_compress
    from shared.kernels import table_code

    blob = encode_ints(np.arange(50, dtype=np.uint64) % 7)
    n_table, n_code, n_raw = _HEAD.unpack_from(blob, 0)
    table = np.zeros(ALPHABET, dtype="<u2")
    table[:7] = 100  # 700, not 4096
    bad_table = zstd_compress(table.tobytes()) if tables == "zstd" else table_code(table.astype(np.int64)).tobytes()
    rest = blob[_HEAD.size + n_table:]
    bad = _HEAD.pack(len(bad_table), n_code, n_raw) + bad_table + rest
    with pytest.raises(DeltaError, match="symbol table does not add up"):
        decode_ints(bad, 50, tables=tables)


@settings(max_examples=80, deadline=None)
@given(st.dictionaries(st.integers(0, 135), st.integers(1, 4096), max_size=136))
def test_table_code_roundtrips_and_refuses_damage(freqs):
    """Format 4's table section reads back exactly, and one cut short, one with a byte too many,
    a symbol past the alphabet or a frequency above 2**12 is refused."""
    from shared.entropy import ALPHABET
    from shared.kernels import table_code, table_decode

    def coded(*values: int) -> np.ndarray:
        """Elias-gamma codes, least significant bit first, written out bit by bit."""
        bits = []
        for v in values:
            q = v.bit_length() - 1
            bits += [1] * q + [0] + [(v >> i) & 1 for i in range(q)]
        bits += [0] * (-len(bits) % 8)
        return np.packbits(np.array(bits, dtype=np.uint8), bitorder="little")

    freq = np.zeros(ALPHABET, dtype=np.int64)
    freq[list(freqs)] = list(freqs.values())
    code = table_code(freq)
    used = sorted(freqs)
    assert np.array_equal(code, coded(len(used) + 1, *[v for s, prev in zip(used, [-1, *used])
                                                       for v in (s - prev, freqs[s])]))
    out = np.full(ALPHABET, 7, dtype=np.uint16)
    assert table_decode(code, out) and np.array_equal(out, freq)
    assert len(code) <= 1 + 5 * len(freqs)
    assert not table_decode(code[:-1], out)
    assert not table_decode(np.append(code, np.uint8(0)), out)
    assert table_decode(coded(2, 136, 4096), out) and out[135] == 4096 and out.sum() == 4096
    assert not table_decode(coded(2, 137, 4096), out)  # symbol 136: past the alphabet
    assert not table_decode(coded(2, 1, 4097), out)  # a frequency above 2**12
    assert not table_decode(coded(138), out)  # more used symbols than the alphabet holds


def test_format_3_files_are_still_read():
    """Format 3 coded each rANS table as a zstd frame of its 136 frequencies; a delta rewritten
    that way (as a format-3 writer made it) decodes and applies to the same bits."""
    import safetensors.torch

    from shared.codec import VAL, payload_digest, save_delta
    from shared.entropy import _HEAD, ints_sections, zstd_compress

    base = bits_state(5, {"a": ((64, 96), torch.bfloat16), "b": ((300,), torch.float32), "c": ((40,), torch.float16)})
    new = perturb(base, 0.02, 6)
    bits = base["a"].view(torch.int16)  # one-ulp steps: rANS-coded wrapping differences
    new["a"] = (bits + (torch.rand(bits.shape, generator=torch.Generator().manual_seed(7)) < 0.05)).view(torch.bfloat16)
    h0 = anchor_header(base, version=0)
    data = encode_delta(base, new, version=1, base_version=0, base_commitment=h0.commitment)
    header = DeltaFile.from_bytes(data).header.model_copy(update={"format_version": 3})
    blobs = safetensors.torch.load(data)
    rans = [n for n, e in header.tensors.items() if e.coders.get(VAL) == "ans"]
    assert rans
    for n in rans:
        blob = blobs[n + VAL].numpy().tobytes()
        table, code_at, raw_at = ints_sections(blob)
        frame = zstd_compress(table.astype("<u2").tobytes())
        old = _HEAD.pack(len(frame), raw_at - code_at, len(blob) - raw_at) + frame + blob[code_at:]
        blobs[n + VAL] = torch.frombuffer(bytearray(old), dtype=torch.uint8)
    header.payload_blake3 = payload_digest(blobs)
    v3 = save_delta(header, blobs)
    assert len(v3) > len(data)
    delta = DeltaFile.from_bytes(v3)
    assert delta.header.format_version == 3
    assert [_outcome(lambda c=c: c) for c in delta.decode(list(base))] == \
        [_outcome(lambda c=c: c) for c in DeltaFile.from_bytes(data).decode(list(base))]
    target = {k: t.clone() for k, t in base.items()}
    apply_delta(delta, target, version=0, commitment=h0.commitment)
    assert same_bits(target, new)


@pytest.mark.parametrize("damage", [None, "hole", "overlap", "trailing byte", "size", "dtype", "offsets"])
def test_delta_file_checks_the_objects_it_views(damage):
    """A file read whole is not copied object by object: its blobs are views of its bytes, so the
    safetensors header's objects are checked as safetensors checks them (bytes that fit each
    object's dtype and shape, covering the data section exactly) and anything else is refused as
    damage. The metadata's own checksum does not cover these entries."""
    import json
    import struct

    base = bits_state(5, {"a": ((64, 48), torch.bfloat16), "b": ((300,), torch.float32)})
    data = encode_delta(base, perturb({k: t.clone() for k, t in base.items()}, 0.05, 6),
                        version=1, base_version=0, base_commitment="")
    (n,) = struct.unpack("<Q", data[:8])
    doc, body = json.loads(data[8:8 + n]), data[8 + n:]
    first, second = sorted((k for k in doc if k != "__metadata__"), key=lambda k: doc[k]["data_offsets"])[:2]
    a, b = doc[first], doc[second]
    if damage == "hole":  # one byte of the data section belongs to no object
        a["data_offsets"][1] -= 1
        a["shape"][0] -= 1
    elif damage == "overlap":
        b["data_offsets"][0] -= 1
        b["shape"][0] += 1
    elif damage == "trailing byte":
        body += b"\0"
    elif damage == "size":
        a["shape"][0] += 1
    elif damage == "dtype":
        a["dtype"] = "X9"
    elif damage == "offsets":
        a["data_offsets"] = "0-9"
    head = json.dumps(doc).encode()
    rebuilt = struct.pack("<Q", len(head)) + head + body
    if damage is None:
        assert DeltaFile.from_bytes(rebuilt).header == DeltaFile.from_bytes(data).header
        return
    with pytest.raises(DeltaError) as e:
        DeltaFile.from_bytes(rebuilt)
    assert e.value.reason == "corrupt", e.value


@pytest.mark.parametrize("whole", [True, False])
def test_delta_file_read_whole_or_tensor_by_tensor(tmp_path, monkeypatch, whole):
    """A file up to IN_MEMORY_MAX is read whole; a larger one through safe_open. Both decode the
    same changes, and both refuse a flipped blob byte before anything is decoded."""
    import shared.codec as codec
    from shared.errors import DeltaError

    if not whole:
        monkeypatch.setattr(codec, "IN_MEMORY_MAX", 0)
    base = bits_state(3, {"a": ((64, 48), torch.bfloat16), "b": ((7,), torch.float32)})
    new = perturb({k: t.clone() for k, t in base.items()}, 0.05, 4)
    data = encode_delta(base, new, version=1, base_version=0, base_commitment="")
    path = tmp_path / "d.safetensors"
    path.write_bytes(data)
    opened = DeltaFile.open(path)
    assert (opened._objects is None) == (not whole)
    target = {k: t.clone() for k, t in base.items()}
    apply_delta(opened, target)
    assert same_bits(target, new)
    damaged = bytearray(data)
    damaged[-3] ^= 0x01  # inside the last blob
    path.write_bytes(bytes(damaged))
    with pytest.raises(DeltaError, match="payload digest"):
        list(DeltaFile.open(path).changes())


@pytest.mark.parametrize("sizes", [[], [0], [300] * 40, [0, 5, 3 << 20, 7, 1 << 20, (1 << 20) - 30, 12]],
                         ids=["none", "one-empty", "one-piece", "pieces"])
def test_payload_digest_is_blake3_over_names_and_bytes(sizes):
    """The payload digest, as the format defines it: blake3 over each blob's name, a NUL and its
    bytes, in name order (other objects left out), whether the blobs fit one piece of the
    joined input or several (blobs above a piece, empty ones); a file of these blobs verifies."""
    import blake3

    from shared.codec import payload_digest, save_delta

    rng = np.random.default_rng(len(sizes))
    blobs = {f"t.{i:02d}::{'val' if i % 2 else 'pos'}": torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8))
             for i, n in reversed(list(enumerate(sizes)))}  # not given in name order
    blobs["dense"] = torch.arange(4, dtype=torch.float32)
    h = blake3.blake3()
    for name in sorted(k for k in blobs if "::" in k):
        h.update(name.encode() + b"\0" + blobs[name].numpy().tobytes())
    assert payload_digest(blobs) == h.hexdigest()
    base = {"w": torch.zeros(64, dtype=torch.bfloat16)}
    header = DeltaFile.from_bytes(encode_delta(base, {"w": base["w"] + 1}, version=1, base_version=0,
                                               base_commitment="")).header  # a header to carry these blobs
    header.payload_blake3 = h.hexdigest()
    DeltaFile.from_bytes(save_delta(header, blobs)).verify()
    header.payload_blake3 = blake3.blake3(b"").hexdigest()
    if sizes:
        with pytest.raises(DeltaError, match="payload digest"):
            DeltaFile.from_bytes(save_delta(header, blobs)).verify()


def _outcome(decode):
    """What decoding gives: the change's bits, or the refusal's reason and message (without the
    tensor name the batched decoder puts first)."""
    try:
        c = decode()
    except DeltaError as e:
        return "refused", e.reason, e.message.rsplit(": ", 1)[-1] if e.message.count(": ") else e.message
    if c is None:
        return None
    return c.mode, None if c.positions is None else c.positions.tolist(), c.bits.view(-1).tolist()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), fraction=st.sampled_from([0.002, 0.02, 0.2]), damage=st.integers(0, 2**16))
def test_batched_decode_equals_one_tensor_at_a_time(seed, fraction, damage):
    """``DeltaFile.decode`` (one numba call for every tensor in the default coding) gives what
    ``change`` gives tensor by tensor, for xor, add and set values in 16- and 32-bit tensors; and
    for a damaged blob (cut short or a bit flipped) the same refusal, or the same bits."""
    shapes = {"a": ((64, 96), torch.bfloat16), "b": ((300,), torch.float32), "c": ((7, 5), torch.float16),
              "d": ((128,), torch.bfloat16), "e": ((50,), torch.int64), "f": ((2, 300), torch.float32)}
    base = bits_state(seed, shapes)
    new = perturb(base, fraction, seed + 1)
    for name in ("d", "f"):  # one-ulp steps: values coded as wrapping differences (add)
        bits = base[name].reshape(-1).view({2: torch.int16, 4: torch.int32}[base[name].element_size()])
        step = (torch.rand(bits.numel(), generator=torch.Generator().manual_seed(seed)) < 0.1).to(bits.dtype)
        new[name] = (bits + step).view(base[name].dtype).reshape(base[name].shape)
    h0 = anchor_header(base, version=0)
    data = bytearray(encode_delta(base, new, version=1, base_version=0, base_commitment=h0.commitment))
    delta = DeltaFile.from_bytes(data)  # blobs are views of ``data``
    names = list(delta.header.tensors)
    assert [_outcome(lambda c=c: c) for c in delta.decode(names)] == [_outcome(lambda n=n: delta.change(n)) for n in names]
    assert {delta.header.tensors[n].encoding for n in names} >= {"add"}
    delta.verify()
    coded = {f"{n}::{part}" for n in names for part in ("pos", "val")
             if delta.header.tensors[n].coders.get(f"::{part}") in ("rice", "ans")}
    sparse = sorted(coded & set(delta._blobs))
    if not sparse:
        return
    rng = np.random.default_rng(damage)
    key = sparse[rng.integers(len(sparse))]
    # past the payload digest: what the decoders themselves must catch
    dtype, _, begin, end = delta._objects[key]
    if rng.integers(2) and end - begin > 1:  # cut short
        end = begin + int(rng.integers(end - begin))
        delta._objects[key] = (dtype, [end - begin], begin, end)
        delta._blobs[key] = delta._data[begin:end]
    else:  # a bit flipped, in the file's bytes that the blobs view
        data[begin + int(rng.integers(end - begin))] ^= 1 << int(rng.integers(8))
    name = key.split("::")[0]
    batched = _outcome(lambda: delta.decode([name])[0])
    assert batched == _outcome(lambda: delta.change(name))


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=6), seed=st.integers(0, 2**16),
       fractions=st.lists(st.sampled_from([0.0, 0.001, 0.02, 0.3]), min_size=6, max_size=6),
       max_changes=st.sampled_from([None, 1, 200]), update=st.booleans())
def test_find_changes_many_is_find_changes_per_tensor(sizes, seed, fractions, max_changes, update):
    """One kernel call for many tensors (both widths, one of them dense, calls split by
    ``max_changes``) gives per tensor what ``find_changes`` gives, and refreshes exactly the
    tensors that were not dense; a tensor whose caps alone exceed ``max_changes`` is left to the
    one-tensor path (False), untouched."""
    from shared.changes import _cap_total, find_changes, find_changes_many

    g = torch.Generator().manual_seed(seed)
    pairs = []
    for i, (n, fraction) in enumerate(zip(sizes, fractions)):
        dtype = (torch.bfloat16, torch.float32)[i % 2]
        base = torch.randn(n, generator=g).to(dtype)
        new = base.clone()
        bits = new.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
        bits[torch.randperm(n, generator=g)[:int(n * fraction)]] ^= 1 << (seed % 15)
        pairs.append((base, new))
    expect_old = [old.clone() for old, _ in pairs]
    expect = [find_changes(old, new, update=update, threads=False) for old, (_, new) in zip(expect_old, pairs)]
    got = find_changes_many(pairs, update=update, max_changes=max_changes)
    for (old, new), e, r, after in zip(pairs, expect, got, expect_old):
        if max_changes is not None and _cap_total(old.numel(), 1 / 16) > max_changes:
            assert r is False
            continue
        if e is None:
            assert r is None
        else:
            assert r.positions.tolist() == e.positions.tolist()
            assert r.xor.tolist() == e.xor.tolist() and r.xor.dtype == e.xor.dtype
            assert r.new.tobytes() == new.view(torch.uint8).numpy().view(r.xor.dtype)[r.positions].tobytes()
        assert torch.equal(old.view(torch.uint8), after.view(torch.uint8))


def test_find_changes_many_leaves_what_it_does_not_take_to_the_one_tensor_path():
    from shared.changes import find_changes_many

    old = torch.zeros(8, dtype=torch.bfloat16)
    cases = [(old, torch.ones(8, dtype=torch.float32)),  # two dtypes (no cast asked)
             (old, torch.ones(16, dtype=torch.bfloat16)[::2]),  # not contiguous
             (old, torch.ones(4, dtype=torch.bfloat16)),  # another shape
             (torch.zeros(8, dtype=torch.int64), torch.ones(8, dtype=torch.int64))]  # no bit view
    assert find_changes_many(cases, update=True) == [False] * 4
    assert torch.count_nonzero(old) == 0
    nan = torch.tensor([1.0, float("nan")])
    snap = torch.zeros(2, dtype=torch.bfloat16)
    assert find_changes_many([(snap, nan), (snap, torch.ones(2, dtype=torch.bfloat16))], cast=True) == [False, False]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), count=st.integers(1, 12))
def test_sparse_changes_coded_together_are_coded_as_one_by_one(seed, count):
    """``encode_changes_many`` (one kernel call for a batch of tensors of one width) writes the
    same entries and bytes as ``encode_changes`` per tensor, including the tensors whose "set" kind
    or zstd'd positions it leaves to their trials: one-ulp moves, random XORs, a constant reset,
    runs of positions, 16- and 32-bit elements."""
    from shared.codec import ChangeBatch, TensorEntry, encode_changes, encode_changes_many

    rng = np.random.default_rng(seed)
    items = []
    for t in range(count):
        dtype = (np.uint16, np.uint32)[int(rng.integers(2))]
        numel = int(rng.integers(1, 50_000))
        n = int(rng.integers(1, min(numel, 6000) + 1))
        kind = ("ulp", "random", "constant", "runs")[int(rng.integers(4))]
        if kind == "runs":
            start = int(rng.integers(0, numel - n + 1))
            positions = np.arange(start, start + n, dtype=np.int64)
        else:
            positions = np.sort(rng.choice(numel, n, replace=False)).astype(np.int64)
        new = rng.integers(0, np.iinfo(dtype).max, n, dtype=dtype, endpoint=True)
        if kind == "constant":
            new[:] = 0x3F00
        if kind == "ulp":  # old = new -2..2 ulps, wrapping
            xor = new ^ (new + rng.choice(np.array([-2, -1, 1, 2]), n).astype(dtype))
        else:
            xor = (rng.integers(1, np.iinfo(dtype).max, n, dtype=dtype, endpoint=True) if kind == "random"
                   else rng.integers(1, 4, n).astype(dtype))
        entry = TensorEntry(dtype="bfloat16" if dtype == np.uint16 else "float32", shape=[numel],
                            fingerprint=f"{t + 1:064x}")
        items.append((f"t{t}", entry, positions, xor, new))
    for width in (np.uint16, np.uint32):
        group = [it for it in items if it[3].dtype == width]
        if not group:
            continue
        names, entries, positions, xor, new = zip(*group)
        batch = ChangeBatch.join(names, positions, xor, new)
        together = encode_changes_many(batch, entries)
        # entries kept as templates, with the fingerprints given apart: the same, templates untouched
        templates = [e.model_copy(update={"fingerprint": ""}) for e in entries]
        from_templates = encode_changes_many(batch, templates, [e.fingerprint for e in entries])
        assert [t.fingerprint for t in templates] == [""] * len(templates)
        for (name, entry, pos, x, n), got, other in zip(group, together, from_templates, strict=True):
            want = encode_changes(entry, name, pos, x, lambda k=None, n=n: n[:k])
            assert got.entry == want.entry == other.entry
            blobs = [{k: bytes(v.numpy()) for k, v in e.blobs.items()} for e in (got, want, other)]
            assert blobs[0] == blobs[1] == blobs[2]


def test_change_batches_join_per_width_and_gather_the_new_bits():
    """``change_batches`` joins the changes of tensors of one element width, with the bits after
    the change at each position (what a fancy index gives), and refuses, by name, a position
    outside its tensor; bits the scan recorded it takes as they are."""
    from shared.changes import Changes, unsigned_view
    from shared.codec import change_batches

    g = torch.Generator().manual_seed(3)
    after = {"a": torch.randn(300, generator=g).bfloat16(), "b": torch.randn(7, 9, generator=g),
             "c": torch.randn(50, generator=g).half()}
    found = {n: Changes(torch.randperm(t.numel(), generator=g)[:k].sort().values.numpy(),
                        np.full(k, 1, dtype=unsigned_view(t).dtype))
             for (n, t), k in zip(after.items(), (40, 5, 0))}
    batches = {b.xor.itemsize: b for b in change_batches(found, after)}
    assert batches[2].names == ["a", "c"] and batches[4].names == ["b"]
    for b in batches.values():
        for k, n in enumerate(b.names):
            pos, xor, new = b.part(k)
            assert np.array_equal(pos, found[n].positions) and np.array_equal(xor, found[n].xor)
            assert np.array_equal(new, unsigned_view(after[n])[found[n].positions])
    found["a"].positions[-1] = 300
    with pytest.raises(ValueError, match="^a: changed positions outside its 300 elements"):
        change_batches(found, after)
    # new bits the scan recorded are taken as they are, not gathered again
    scanned = {n: Changes(c.positions, c.xor, np.arange(c.count, dtype=c.xor.dtype)) for n, c in found.items()}
    for b in change_batches(scanned, after):
        assert b.new.tolist() == [j for n in b.names for j in range(found[n].count)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(patches=st.lists(st.tuples(st.sampled_from([torch.uint8, torch.int16, torch.int32, torch.float32]),
                                  st.integers(1, 300), st.floats(0, 1), st.sampled_from(["kernel", "int32", "all"])),
                        min_size=1, max_size=6),
       damaged=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_read_back_is_bit_for_bit_per_patch(patches, damaged, seed):
    """``landed`` (the replica's read-back) says of each patch, written, that its target holds
    its new bits, bit for bit (a NaN written reads back as written); one element changed after
    the write, or a position outside the target, fails that patch and no other. Patches at
    int64 positions on the CPU take the kernel, the rest torch."""
    g = torch.Generator().manual_seed(seed)
    made = []
    for dtype, numel, fraction, kind in patches:
        target = torch.randint(0, 100, (numel,), dtype=torch.int32, generator=g).to(dtype)
        positions = None if kind == "all" else torch.randperm(numel, generator=g)[:max(1, int(numel * fraction))]
        if kind == "int32":
            positions = positions.int()
        count = numel if positions is None else positions.numel()
        new = torch.randint(0, 100, (count,), dtype=torch.int32, generator=g).to(dtype)
        if dtype == torch.float32:
            new[0] = float("nan")
        made.append(apply_module.Patch("t", target, positions, new, new.clone()))
    for p in made:  # (index_copy_, a patch's own write, takes int64 positions only)
        p.target[slice(None) if p.positions is None else p.positions.long()] = p.new
    assert apply_module.landed(made) == [True] * len(made)
    k = damaged % len(made)
    p = made[k]
    at = 0 if p.positions is None else int(p.positions[0])
    p.target.view(torch.uint8)[at * p.target.element_size()] ^= 1
    assert apply_module.landed(made) == [i != k for i in range(len(made))]
    p.target.view(torch.uint8)[at * p.target.element_size()] ^= 1
    if p.positions is not None and p.positions.dtype == torch.int64:
        outside = apply_module.Patch("t", p.target, p.positions.clone(), p.new, p.old)
        outside.positions[-1] = p.target.numel()
        assert apply_module.landed([*made, outside]) == [True] * len(made) + [False]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seed", range(4))
def test_in_place_patch_writes_its_members_of_a_batch_and_reverts_them_exactly(dtype, seed):
    """One InPlacePatch writes a joined batch (XOR and wrapping add) into several tensors, the
    members it is given only; revert gives back the very bits; a position outside a tensor
    refuses the whole patch before any write."""
    g = torch.Generator().manual_seed(seed)
    iv = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[dtype]
    sizes, modes = [97, 1, 300, 64], ["xor", "add", "set", "add"]
    targets = [torch.randn(n, generator=g).to(dtype).view(iv) for n in sizes]
    before = [t.clone() for t in targets]
    positions = [torch.randperm(n, generator=g)[:max(1, n // 3)].sort().values for n in sizes]
    bits = [torch.randint(-2**15, 2**15, (p.numel(),), generator=g).to(iv) for p in positions]
    bits[1][0] = torch.iinfo(iv).max  # wraps
    bounds = np.cumsum([0] + [p.numel() for p in positions])
    members = [0, 1, 3]  # "set" is not written in place
    patch = apply_module.InPlacePatch([f"t{k}" for k in range(4)], modes, targets, torch.cat(positions),
                                      torch.cat(bits), bounds, members)
    assert patch.names == ["t0", "t1", "t3"]
    patch.apply()
    patch.apply()  # once only
    for k, (t, b, p, v) in enumerate(zip(targets, before, positions, bits)):
        want = b.clone()
        if k in members:
            want[p] = want[p] ^ v if modes[k] == "xor" else (want[p].long() + v.long()).to(iv)
        assert torch.equal(t, want), k
    patch.revert()
    assert all(torch.equal(t, b) for t, b in zip(targets, before))
    outside = torch.cat(positions)
    outside[bounds[4] - 1] = sizes[3]
    bad = apply_module.InPlacePatch([f"t{k}" for k in range(4)], modes, targets, outside, torch.cat(bits), bounds,
                                    members)
    with pytest.raises(ValueError, match="t3: positions outside its 64 elements"):
        bad.apply()
    assert not bad.applied and all(torch.equal(t, b) for t, b in zip(targets, before))
