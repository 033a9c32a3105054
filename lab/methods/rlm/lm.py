"""The two model primitives RLM needs: greedy generation with stop strings, and scoring a set of candidate
continuations in one forward over their token trie (the constrained decoding of the action mode).

`score_candidates` builds a trie of the candidates' token ids (shared prefixes become shared nodes), runs the
prompt once and the whole trie in one tree-attention forward (`lab.engine.runtime.verify_tree`), and returns each
candidate's log p(candidate | prompt) = sum_t log softmax(z_t)[y_t] and its token count. Decoding restricted to
the trie's paths is exactly choosing argmax of these sums (or of their per-token mean, which the caller uses
so short and long actions compete fairly).
Not covered: sampling (both primitives are greedy / exact), batching several prompts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lab.engine import runtime
from lab.engine.models import LoadedModel
from lab.engine.tree_attention import build_tree_attention


@dataclass(frozen=True)
class Generation:
    text: str
    prompt_tokens: int
    output_tokens: int
    forwards: int


def window(loaded: LoadedModel) -> int:
    """The model's context window in tokens (8192 for SmolLM2)."""
    return int(getattr(loaded.config, "max_position_embeddings", 0) or 2048)


def generate(
    loaded: LoadedModel, prompt_ids: list[int], max_new_tokens: int, stop: Callable[[str], bool] | None = None
) -> Generation:
    """Greedy decoding until EOS, `stop(text so far)`, or `max_new_tokens`; the prompt is cut from the left."""
    limit = window(loaded) - max_new_tokens - 1
    prompt_ids = prompt_ids[-limit:] if len(prompt_ids) > limit else prompt_ids
    state, out = runtime.prefill(loaded, prompt_ids)
    generated: list[int] = []
    try:
        for _ in range(max_new_tokens):
            token = int(out.logits[-1].argmax())
            if token in loaded.eos_token_ids:
                break
            generated.append(token)
            if stop is not None and stop(loaded.decode(generated)):
                break
            out = runtime.decode_step(state, token)
        return Generation(loaded.decode(generated), len(prompt_ids), len(generated), state.forwards)
    finally:
        state.cache.reset()


def _trie(sequences: list[list[int]]) -> tuple[list[int], list[int], list[list[int]]]:
    """Flatten token sequences into a trie: node tokens, node parents (-1 = prompt) and each sequence's nodes."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}
    paths = []
    for sequence in sequences:
        node, path = -1, []
        for token in sequence:
            key = (node, token)
            if key not in children:
                children[key] = len(tokens)
                tokens.append(token)
                parents.append(node)
            node = children[key]
            path.append(node)
        paths.append(path)
    return tokens, parents, paths


@dataclass(frozen=True)
class Choice:
    """The result of decoding constrained to a set of candidates."""

    index: int  # the most probable candidate under the constrained distribution
    logprobs: list[float]  # log p_constrained(candidate): per token, softmax over the allowed children only
    prompt_tokens: int
    trie_tokens: int


def _constrained_logprobs(logits: torch.Tensor, allowed: list[int]) -> dict[int, float]:
    """log softmax of `logits` restricted to the `allowed` token ids (the grammar's mask)."""
    values = torch.log_softmax(logits[allowed].float(), dim=-1).tolist()
    return dict(zip(allowed, values, strict=True))


@torch.inference_mode()
def choose(loaded: LoadedModel, prompt_ids: list[int], candidates: list[str]) -> Choice:
    """Token-trie constrained decoding over `candidates` (strings that continue the prompt), exact MAP.

    The candidates' token sequences form a trie; the prompt runs once and the whole trie in one tree-attention
    forward, which gives the next-token logits at every trie node. Constrained decoding masks each node's logits
    to its children (the tokens the grammar allows there) and renormalizes: log p_c(y) = sum_t log softmax(z_t
    restricted to allowed)[y_t]. With every node scored, the most probable complete candidate is found exactly
    (greedy trie walking can be trapped by a shared prefix, e.g. "6" of 6 and 6803); forced tokens (one child)
    cost nothing, so long arguments are not penalized for their length. The prompt is cut from the left to fit."""
    sequences = [loaded.tokenizer(text, add_special_tokens=False)["input_ids"] or [0] for text in candidates]
    tokens, parents, paths = _trie(sequences)
    limit = window(loaded) - len(tokens) - 1
    prompt_ids = prompt_ids[-limit:] if len(prompt_ids) > limit else prompt_ids
    state, out = runtime.prefill(loaded, prompt_ids)
    try:
        node_logits = runtime.verify_tree(state, build_tree_attention(parents), tokens).logits  # [N, V]
    finally:
        state.cache.reset()
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    masked = {
        parent: _constrained_logprobs(out.logits[-1] if parent < 0 else node_logits[parent], [tokens[n] for n in kids])
        for parent, kids in children.items()
    }
    logprobs = []
    for sequence, path in zip(sequences, paths, strict=True):
        parents_on_path = [-1] + path[:-1]
        logprobs.append(round(sum(masked[p][t] for p, t in zip(parents_on_path, sequence, strict=True)), 4))
    index = max(range(len(logprobs)), key=logprobs.__getitem__)
    return Choice(index, logprobs, len(prompt_ids), len(tokens))
