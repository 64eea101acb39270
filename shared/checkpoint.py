"""Read and write checkpoints in Hugging Face coordinates (a safetensors file or a sharded folder)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import safetensors.torch
import torch


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


def checkpoint_files(path: str | Path) -> list[Path]:
    p = Path(path)
    if p.is_file():
        return [p]
    index = p / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [p / s for s in shards]
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors checkpoint at {p}")
    return files


def load_state(path: str | Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(path):
        state.update(safetensors.torch.load_file(str(f)))
    return state


def save_state(state: Mapping[str, torch.Tensor], path: str | Path,
               metadata: Mapping[str, str] | None = None) -> None:
    tensors = {n: t.detach().contiguous() for n, t in state.items()}
    safetensors.torch.save_file(tensors, str(path), metadata=dict(metadata or {"format": "pt"}))
