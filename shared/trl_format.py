"""Import path for the TRL prototype's sparse delta files.

That format stores, per changed tensor, ``<name>.indices`` (int32 flat positions) and
``<name>.values`` (the new values in the tensor's dtype), with metadata ``sparse`` and
``changed_params``. It carries no digests or shapes, so it can only be checked against the base
it is applied to (names, dtypes, index bounds), never proven to be the intended result.
"""

from __future__ import annotations

from pathlib import Path

import safetensors
import torch

from .apply import flat_bits
from .codec import TensorChange
from .errors import DeltaError

INDICES, VALUES = ".indices", ".values"


def is_trl_delta(path: str | Path) -> bool:
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            keys = list(f.keys())
    except Exception:
        return False
    if "deltasync" in meta:
        return False
    return any(k.endswith(INDICES) for k in keys) and any(k.endswith(VALUES) for k in keys)


def read_trl_delta(path: str | Path, base: dict[str, torch.Tensor]) -> list[TensorChange]:
    """Overwrite changes in our terms, checked against ``base``."""
    changes = []
    with safetensors.safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        for key in sorted(k for k in keys if k.endswith(INDICES)):
            name = key[: -len(INDICES)]
            if name + VALUES not in keys:
                raise DeltaError("format", f"{name}: indices without values")
            if name not in base:
                raise DeltaError("shape_mismatch", f"{name}: not in the base checkpoint")
            idx = f.get_tensor(key).to(torch.int64).reshape(-1)
            vals = f.get_tensor(name + VALUES).reshape(-1)
            t = base[name]
            if vals.dtype != t.dtype or vals.numel() != idx.numel():
                raise DeltaError("shape_mismatch", f"{name}: {vals.numel()} {vals.dtype} values for "
                                 f"{idx.numel()} indices into {t.dtype}")
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= t.numel()):
                raise DeltaError("corrupt", f"{name}: index outside a tensor of {t.numel()} elements")
            changes.append(TensorChange(name, "set", idx, flat_bits(vals.contiguous())))
    return changes
