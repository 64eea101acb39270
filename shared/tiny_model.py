"""Build small Qwen3 models locally and deterministically (no model hub is reachable in tests).

The result is an ordinary Hugging Face model folder (config, safetensors weights, tokenizer)
that transformers and vLLM load like any Hub model. Weights are drawn from a fixed seed with
LLM-like scales, so the bf16 statistics of training steps on them resemble a real model's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Weights change a little at every optimizer step; most bf16 bits stay the same.",
    "Guess the five letter word: crane, slate, audio, raise, pious, mound.",
    "Asynchronous reinforcement learning trains on one cluster and samples on another.",
    "A delta carries only the changed weights, exactly to the bit.",
    "Once upon a time there was a small model that learned to play word games.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'\"()[]{}<>-_=+/*&%$#@",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3's chat and tool-call markers, so a real Qwen3 chat template (trl's) renders to single tokens.
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
           "</tool_call>", "<tool_response>", "</tool_response>"]


def build_tokenizer(out: Path, vocab_size: int, chat_template: str = CHAT_TEMPLATE,
                    corpus: Sequence[str] = ()) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([*CORPUS, *corpus] * 4, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "model_max_length": 4096, "chat_template": chat_template,
    }, indent=2))
    return tok.get_vocab_size()


def build_tiny_model(out: str | Path, *, hidden: int = 64, layers: int = 2, heads: int = 2,
                     kv_heads: int = 1, head_dim: int = 32, intermediate: int = 128,
                     vocab_size: int = 512, tie_word_embeddings: bool = True,
                     seed: int = 0, chat_template: str = CHAT_TEMPLATE, corpus: Sequence[str] = ()) -> Path:
    """Write a Qwen3 model folder; the same arguments always give the same bytes.

    ``corpus`` adds tokenizer training text, so prompts a test or demo sends often are short.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    n_vocab = build_tokenizer(out, vocab_size, chat_template, corpus)
    config = Qwen3Config(
        vocab_size=n_vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=4096, tie_word_embeddings=tie_word_embeddings,
        torch_dtype="bfloat16", bos_token_id=None, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # LLM-like scales: small matrices, unit norms
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.05 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.02)
    model.to(torch.bfloat16).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "pad_token_id": 0}))
    return out


def main() -> None:  # pragma: no cover - a convenience entry point
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--untied", action="store_true")
    a = ap.parse_args()
    build_tiny_model(a.out, hidden=a.hidden, layers=a.layers, intermediate=a.intermediate,
                     vocab_size=a.vocab, tie_word_embeddings=not a.untied)


if __name__ == "__main__":
    main()
