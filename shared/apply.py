"""Apply a decoded delta in place, all or nothing.

Every change is first turned into plain new bits at known positions (an XOR becomes ``old ^ x``,
gathered from the live tensor) while keeping the old bits. Writing is then an ``index_copy_``:
cheap, idempotent (so an aliased tensor such as a tied embedding written twice is harmless, and an
XOR can never be applied twice), and undone by one more ``index_copy_`` of the old bits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .changes import INT_VIEW
from .codec import DeltaFile, Header, TensorChange
from .digest import TORCH_DTYPES, tensor_digest
from .errors import DeltaError


def flat_bits(t: torch.Tensor) -> torch.Tensor:
    """Flat view of a tensor's storage as the integer type the codec uses for its bits."""
    flat = t.detach().view(-1)
    return flat.view(INT_VIEW[t.dtype]) if t.dtype in INT_VIEW else flat


@dataclass
class Patch:
    name: str
    target: torch.Tensor  # flat integer view of live storage
    positions: torch.Tensor | None  # None: every element
    new: torch.Tensor
    old: torch.Tensor

    def apply(self) -> None:
        _write(self.target, self.positions, self.new)

    def revert(self) -> None:
        _write(self.target, self.positions, self.old)


def _write(target: torch.Tensor, positions: torch.Tensor | None, bits: torch.Tensor) -> None:
    if positions is None:
        target.copy_(bits.reshape(-1).view(target.dtype) if bits.dtype != target.dtype else bits.reshape(-1))
    else:
        target.index_copy_(0, positions, bits)


def make_patch(change: TensorChange, target: torch.Tensor) -> Patch:
    """Gather the old bits of one change from its live flat target and compute the new ones."""
    if change.positions is None:
        old = target.clone()
    else:
        old = target.index_select(0, change.positions)
    new = change.bits.reshape(-1) if change.mode == "full" else change.new_bits(old)
    if change.mode == "full" and new.dtype != target.dtype:
        new = new.view(target.dtype)
    return Patch(change.name, target, change.positions, new, old)


def check_target(header: Header, target: Mapping[str, torch.Tensor]) -> None:
    missing = sorted(set(header.tensors) - set(target))
    if missing:
        raise DeltaError("shape_mismatch", f"target lacks {len(missing)} tensors, e.g. {missing[:3]}")
    for name, e in header.tensors.items():
        t = target[name]
        if list(t.shape) != e.shape or t.dtype != TORCH_DTYPES[e.dtype]:
            raise DeltaError("shape_mismatch", f"{name}: target is {tuple(t.shape)}/{t.dtype}, "
                             f"delta says {tuple(e.shape)}/{e.dtype}")


def check_base(header: Header, *, version: int | None, commitment: str | None,
               state_digest: str | None = None) -> None:
    """Refuse a delta that does not start exactly where the target is.

    A target known by commitment (a replica in a chain) is checked by commitment and version; a
    plain checkpoint, which has no commitment, by its state digest.
    """
    if header.kind != "delta":
        return
    if state_digest is not None and header.base_state_digest and header.base_state_digest != state_digest:
        raise DeltaError("wrong_base", f"delta v{header.version} builds on state "
                         f"{header.base_state_digest[:12]}…, target is {state_digest[:12]}…")
    if commitment is not None and header.base_commitment != commitment:
        raise DeltaError("wrong_base", f"delta v{header.version} builds on commitment "
                         f"{header.base_commitment[:12]}…, target holds {commitment[:12]}…")
    if version is not None and header.base_version != version:
        raise DeltaError("out_of_order", f"delta v{header.version} builds on v{header.base_version}, "
                         f"target is at v{version}")


def prepare(delta: DeltaFile, target: Mapping[str, torch.Tensor]) -> list[Patch]:
    """Decode and gather everything needed; touches no weight, so any error leaves all as it was."""
    check_target(delta.header, target)
    return [make_patch(c, flat_bits(target[c.name])) for c in delta.changes()]


def commit(patches: list[Patch], verify: Mapping[str, str] | None = None,
           target: Mapping[str, torch.Tensor] | None = None) -> None:
    """Write all patches; if a digest in ``verify`` (name -> digest) then fails, revert them all."""
    done: list[Patch] = []
    try:
        for p in patches:
            p.apply()
            done.append(p)
        for name, digest in (verify or {}).items():
            if tensor_digest(target[name]) != digest:
                raise DeltaError("digest_mismatch", f"{name}: digest after apply does not match")
    except BaseException:
        for p in reversed(done):
            p.revert()
        raise


def apply_delta(delta: DeltaFile, target: Mapping[str, torch.Tensor] | torch.nn.Module, *,
                version: int | None = None, commitment: str | None = None,
                state_digest: str | None = None, verify: bool = True) -> Header:
    """Apply an anchor or delta in place; on any failure the target is left exactly as it was."""
    from .checkpoint import module_state

    state = module_state(target) if isinstance(target, torch.nn.Module) else target
    check_base(delta.header, version=version, commitment=commitment, state_digest=state_digest)
    patches = prepare(delta, state)
    touched = {p.name: delta.header.tensors[p.name].digest for p in patches} if verify else None
    with torch.no_grad():
        commit(patches, touched, state)
    return delta.header
