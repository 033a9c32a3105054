"""Forward passes and KV-cache handling shared by every strategy (docs/architecture.md section 4).

Covered: prefill, one decode step, a multi-token verify step (a chain), a tree verify step (4D tree mask from
`lab.engine.tree_attention`), per-layer hidden states, early-exit logits `lm_head(h_l)` (optionally through the final
norm), and KV rollback: `crop(n)` for chains, `select(positions)` to keep an accepted tree path.
Each call that runs the model counts one forward in `DecodeState.forwards` (the "target forwards" statistic).
Llama-architecture models run through `lab.engine.lean_forward` (the same numbers as `model(...)`, less per-module
overhead; on a CPU the decode steps' and verify forwards' layers as one C++ call, `lab.engine.native_forward`); other
models through `model(...)`.
Not covered: batching several sequences (CFG batches its two branches itself), paged or static caches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from lab.engine.lean_forward import lean_forward
from lab.engine.models import LoadedModel
from lab.engine.profile import section
from lab.engine.tree_attention import TreeAttention


@dataclass
class ForwardOutput:
    """Logits of the positions that were asked for and, when requested, every layer's hidden states."""

    logits: torch.Tensor  # [T, V] float32
    # (L + 1) x [T, H]: [0] = embeddings, [l] = after layer l; as in HF, [L] is already through the final norm
    hidden_states: tuple[torch.Tensor, ...] | None = None


@dataclass
class DecodeState:
    """One sequence being decoded: the model, its KV cache and how many forwards it has cost."""

    loaded: LoadedModel
    cache: DynamicCache
    forwards: int = 0
    tokens: list[int] = field(default_factory=list)  # every token whose KV is in the cache

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()


def new_state(loaded: LoadedModel) -> DecodeState:
    return DecodeState(loaded, DynamicCache(config=loaded.config))


@torch.inference_mode()
def forward(
    state: DecodeState,
    token_ids: list[int],
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    last_only: bool = False,
    hidden_states: bool = False,
) -> ForwardOutput:
    """Run `token_ids` after the cached prefix, append their KV to the cache, return float32 logits."""
    loaded = state.loaded
    input_ids = torch.tensor([token_ids], dtype=torch.long, device=loaded.device)  # [1, T]
    options = {
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "logits_to_keep": 1 if last_only else 0,
        "output_hidden_states": hidden_states,
    }
    if loaded.lean:  # transformers' arithmetic without its per-module dispatch (lab.engine.lean_forward)
        logits, hidden = lean_forward(loaded.model, input_ids, state.cache, **options)
    else:
        out = loaded.model(input_ids=input_ids, cache=state.cache, use_cache=True, **options)
        logits, hidden = out.logits, out.hidden_states
    state.forwards += 1
    state.tokens.extend(token_ids)
    return ForwardOutput(logits[0].float(), tuple(h[0] for h in hidden) if hidden_states else None)  # [T, V]


def prefill(
    loaded: LoadedModel, prompt_ids: list[int], *, hidden_states: bool = False
) -> tuple[DecodeState, ForwardOutput]:
    """Encode the prompt into a fresh cache; returns the state and the logits of the last prompt position."""
    if not prompt_ids:
        raise ValueError("prefill needs at least one prompt token")
    state = new_state(loaded)
    return state, forward(state, prompt_ids, last_only=not hidden_states, hidden_states=hidden_states)


def decode_step(state: DecodeState, token_id: int, *, hidden_states: bool = False) -> ForwardOutput:
    """One token in, the next-token logits out (logits shape [1, V])."""
    return forward(state, [token_id], hidden_states=hidden_states)


def verify(state: DecodeState, token_ids: list[int], *, hidden_states: bool = False) -> ForwardOutput:
    """Score a chain of tokens in one forward: row i holds the logits that follow token_ids[i]."""
    return forward(state, token_ids, hidden_states=hidden_states)


def verify_tree(
    state: DecodeState, tree: TreeAttention, token_ids: list[int], *, hidden_states: bool = False
) -> ForwardOutput:
    """Score every node of a draft tree in one forward with the tree attention mask (docs/architecture.md section 4).

    Node i attends to the whole cached prefix and to its ancestors in the tree; its position is
    n_past + depth(i). Row i of the logits is the target distribution after the root-to-node-i path.
    """
    n_past = state.length
    device = state.loaded.device
    mask = tree.attention_mask(n_past).to(device)  # [1, 1, N, n_past + N]
    positions = (tree.depths + n_past).unsqueeze(0).to(device)  # [1, N]
    return forward(state, token_ids, attention_mask=mask, position_ids=positions, hidden_states=hidden_states)


@torch.inference_mode()
def early_exit_logits(loaded: LoadedModel, hidden: torch.Tensor, *, apply_norm: bool = False) -> torch.Tensor:
    """Logit-lens / early exit: lm_head(h_l), or lm_head(norm(h_l)) when `apply_norm` (float32 [T, V]).

    For l < L this is the early exit DoLa uses; hidden_states[L] is already normalized, so lm_head(h_L) is the
    model's own final logits (do not pass apply_norm for it).
    """
    if apply_norm:
        hidden = loaded.final_norm(hidden)
    return loaded.lm_head(hidden).float()


def crop(state: DecodeState, length: int) -> None:
    """Roll the cache back to its first `length` positions (rejected chain tokens are forgotten)."""
    if not 0 <= length <= state.length:
        raise ValueError(f"cannot crop a cache of {state.length} positions to {length}")
    with section("KV compaction"):
        state.cache.crop(length - state.length)  # transformers 5.x: crop(-n) drops the last n positions
    del state.tokens[length:]


def select(state: DecodeState, positions: list[int]) -> None:
    """Keep only the cache positions `positions` (e.g. prefix + an accepted tree path), in that order."""
    with section("KV compaction"):
        index = torch.tensor(positions, dtype=torch.long, device=state.loaded.device)
        for layer in state.cache.layers:
            layer.keys = layer.keys.index_select(-2, index)  # [B, heads, T, d]
            layer.values = layer.values.index_select(-2, index)
    state.tokens[:] = [state.tokens[p] for p in positions]
