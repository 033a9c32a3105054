"""Tiny random models built in code for exactness tests (no download, seeded)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lab.engine.models import LoadedModel, wrap_model


class ByteTokenizer:
    """A 256-symbol tokenizer (one token per byte) with the methods LoadedModel uses."""

    eos_token_id = 0
    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": list(text.encode("utf-8")) or [1]}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        kept = [i for i in ids if not (skip_special_tokens and i == self.eos_token_id)]
        return bytes(kept).decode("utf-8", errors="replace")


def tiny_llama(seed: int = 0, layers: int = 2, hidden: int = 64, vocab: int = 256) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def tiny_loaded_model(seed: int = 0, **kwargs) -> LoadedModel:
    return wrap_model(tiny_llama(seed, **kwargs), ByteTokenizer(), spec=f"tiny-llama-{seed}")
