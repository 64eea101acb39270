"""Read and write checkpoints in Hugging Face coordinates (a safetensors file or a sharded folder)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from .errors import DeltaError


def module_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's tensors under checkpoint names, live (no copy).

    A tied weight appears once, under its first name (``model.embed_tokens.weight``, not
    ``lm_head.weight``), as in a saved Hugging Face checkpoint. Tied means the same tensor: the
    same storage at the same offset with the same dtype, shape and strides. Parameters that are
    views into one flat buffer (FSDP flat parameters, ZeRO, Megatron's distributed optimizer)
    share a storage at different offsets and are all kept.
    """
    seen: set[tuple] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        t = t.data if isinstance(t, torch.nn.Parameter) else t
        if t.numel():
            key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype,
                   tuple(t.shape), t.stride())
            if key in seen:
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


# Tied word embeddings, in Hugging Face names: the output embedding a checkpoint may store although
# the model ties it, and the input embeddings it can be tied to.
TIED_OUTPUTS = ("lm_head.weight",)
TIED_INPUTS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight",
               "tok_embeddings.weight")


def declares_tied_embeddings(path: str | Path) -> bool:
    """Whether the ``config.json`` beside a checkpoint ties the word embeddings
    (``tie_word_embeddings``, at the top or in ``text_config``; absent means transformers'
    default, true). No readable config: false, nothing is taken to be tied."""
    p = Path(path)
    cfg_file = (p if p.is_dir() else p.parent) / "config.json"
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(cfg, dict):
        return False
    for c in (cfg, cfg.get("text_config")):
        if isinstance(c, dict) and "tie_word_embeddings" in c:
            return bool(c["tie_word_embeddings"])
    return True


def _aliases(path: str | Path, specs: Mapping[str, tuple[torch.dtype | str, tuple[int, ...]]],
             get: Callable[[str], torch.Tensor]) -> list[str]:
    if not declares_tied_embeddings(path):
        return []
    out = []
    for name in sorted(specs):
        if not name.endswith(TIED_OUTPUTS):
            continue
        for other in sorted(specs):
            if other.endswith(TIED_INPUTS) and specs[other] == specs[name]:
                a, b = get(name), get(other)
                if torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
                    out.append(name)
                    break
    return out


def tied_aliases(path: str | Path) -> list[str]:
    """Tensors a checkpoint stores although the model ties them: an output embedding
    (``lm_head.weight``) whose config ties the word embeddings and whose bits are exactly those
    of an input embedding (``model.embed_tokens.weight``) it also stores.

    This is the one rule for which tensors make up a checkpoint's state, on every side: a tied
    weight is one tensor, under its input embedding's name. :func:`module_state` gives a tied
    model's tensor once, :func:`load_state` leaves the alias out, and a rollout replica leaves it
    out of the tensor list it hashes, so a checkpoint that saved ``lm_head.weight`` anyway has the
    same state digest as the model trained from it. An ``lm_head.weight`` with other bits is not
    an alias and is kept (the engine then serves the embedding, and the digests say so)."""
    with ExitStack() as stack:
        where: dict[str, object] = {}
        specs: dict[str, tuple[str, tuple[int, ...]]] = {}
        for f in checkpoint_files(path):
            fh = stack.enter_context(safetensors.safe_open(str(f), framework="pt"))
            for n in fh.keys():
                sl = fh.get_slice(n)
                where[n], specs[n] = fh, (sl.get_dtype(), tuple(sl.get_shape()))
        return _aliases(path, specs, lambda n: where[n].get_tensor(n))


def load_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, less the aliases of tied weights (see :func:`tied_aliases`).
    A tensor name in two shards is refused (no file silently wins), and so is a file that is not
    safetensors."""
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
    for name in _aliases(path, {n: (t.dtype, tuple(t.shape)) for n, t in state.items()}, state.__getitem__):
        del state[name]
    return state


def save_state(state: Mapping[str, torch.Tensor], path: str | Path,
               metadata: Mapping[str, str] | None = None) -> None:
    tensors = {n: t.detach().contiguous() for n, t in state.items()}
    safetensors.torch.save_file(tensors, str(path), metadata=dict(metadata or {"format": "pt"}))
