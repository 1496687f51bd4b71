"""A tiny random decoder and a byte tokenizer: the whole evaluation runs on them in seconds (tests, demos).

The model is a 2-layer Llama with random weights (seeded), head_dim 32 so every preset format applies. Its
answers are noise, but noise that depends on every cached key and value, which is what the harness's
plumbing tests need. Weights are drawn wider than a trained model's init so attention is peaked and a
broken cache visibly changes the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["ByteTokenizer", "tiny_model"]


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255, plus an end-of-sequence id 256 (vocab 257). No chat template."""

    vocab_size = 257
    eos_token_id = 256
    eos_token = "<eos>"
    pad_token_id = 256
    unk_token_id = None
    bos_token = None
    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = False, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False, **_: Any) -> str:
        data = bytes(i for i in ids if 0 <= i < 256)
        text = data.decode("utf-8", errors="replace")
        if not skip_special_tokens and self.eos_token_id in ids:
            text += self.eos_token
        return text

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.eos_token_id if token == self.eos_token else None


def tiny_model(
    seed: int = 0, layers: int = 2, hidden: int = 64, max_positions: int = 4096
) -> tuple[Any, ByteTokenizer]:
    """A seeded random ``LlamaForCausalLM`` (float32, eval mode, sdpa attention) and a :class:`ByteTokenizer`.

    Args:
        seed: the weights' seed.
        layers: decoder layers.
        hidden: hidden size (2 heads of 32; 1 kv head: grouped-query attention).
        max_positions: ``max_position_embeddings``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = ByteTokenizer()
    cfg = LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=max_positions,
        initializer_range=0.25,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    model.eval()
    return model, tok
