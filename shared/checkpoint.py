"""Read and write checkpoints in Hugging Face coordinates (a safetensors file or a sharded folder)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from .errors import DeltaError


def module_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's tensors under checkpoint names, live (no copy).

    A tied weight appears once, under its first name (``model.embed_tokens.weight``, not
    ``lm_head.weight``), as in a saved Hugging Face checkpoint.
    """
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        t = t.data if isinstance(t, torch.nn.Parameter) else t
        key = t.untyped_storage().data_ptr() if t.numel() else id(t)
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


INDEX = "model.safetensors.index.json"


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the file itself, the shards a folder's index names,
    or a folder's single ``.safetensors`` file. Several files without an index are refused: which
    of them make up the checkpoint (and which wins where they overlap) would be a guess."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file or folder")
    index = p / INDEX
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DeltaError("format", f"{index}: not a safetensors index ({str(e).splitlines()[0]})") from None
        missing = [s for s in shards if not (p / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are not there: {', '.join(missing[:3])}")
        return [p / s for s in shards]
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors checkpoint at {p}")
    if len(files) > 1:
        names = ", ".join(f.name for f in files[:3]) + (", ..." if len(files) > 3 else "")
        raise DeltaError("format", f"{p}: {len(files)} .safetensors files ({names}) and no {INDEX}; "
                                   "give one file, or add the index that says which shards form the checkpoint")
    return files


def load_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint. A tensor name in two shards is refused (no file silently
    wins), and so is a file that is not safetensors."""
    state: dict[str, torch.Tensor] = {}
    seen: dict[str, Path] = {}
    for f in checkpoint_files(path):
        try:
            tensors = safetensors.torch.load_file(str(f))
        except safetensors.SafetensorError as e:
            raise DeltaError("format", f"{f}: not a safetensors file ({str(e).splitlines()[0]})") from None
        for name in tensors:
            if name in seen:
                raise DeltaError("format", f"{path}: tensor {name!r} is in both {seen[name].name} and "
                                           f"{f.name}; a checkpoint holds each tensor once")
            seen[name] = f
        state.update(tensors)
    return state


def save_state(state: Mapping[str, torch.Tensor], path: str | Path,
               metadata: Mapping[str, str] | None = None) -> None:
    tensors = {n: t.detach().contiguous() for n, t in state.items()}
    safetensors.torch.save_file(tensors, str(path), metadata=dict(metadata or {"format": "pt"}))
