"""Forward passes and KV-cache handling shared by every strategy (docs/architecture.md section 4).

Covered: prefill, one decode step, a multi-token verify step (a chain), a tree verify step (4D tree mask from
`lab.engine.tree_attention`), per-layer hidden states, early-exit logits `lm_head(h_l)` (optionally through the final
norm), and KV rollback: `crop(n)` for chains, `select(positions)` to keep an accepted tree path.
Each call that runs the model counts one forward in `DecodeState.forwards` (the "target forwards" statistic).
Every forward runs through `model_forward`, on the path `lab.engine.forward_path` fixed for the run: Llama-architecture
models through `lab.engine.lean_forward` (the same numbers as `model(...)`, less per-module overhead; on a CPU the
decode steps' and verify forwards' layers as one C++ call, `lab.engine.native_forward`), other models through
`model(...)`.
A cache's tensors belong to that cache alone: callers read them but never keep one across a forward or a crop, and a
copy of a cache is a deep copy (`copy.deepcopy`), because the positions past a cache's length are free for its next
forward to write (the C++ op extends caches in place, `lab.engine.native_forward`; `select` compacts in place).
Not covered: padding and masking a batch of sequences (`forward_rows` runs one its caller built: CFG's two
branches), paged or static caches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from lab.engine import forward_path
from lab.engine.lean_forward import lean_forward, lean_steps
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
def model_forward(
    loaded: LoadedModel,
    input_ids: torch.Tensor,
    cache: DynamicCache,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    logits_to_keep: int = 0,
    hidden_states: bool = False,
    lm_head: bool = True,
) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...] | None]:
    """The one call that runs the model: (logits [B, T', V] in the model's dtype or None without `lm_head`,
    (L + 1) x [B, T, H] hidden states or None) of `input_ids` [B, T] after `cache`, which is extended in place.

    Every forward of the lab goes through here (the strategies through `forward` below, batched callers such as
    CFG's two branches, Tree of Thoughts' sampled rows and the distillation batches directly), so each takes the
    run's forward path (`lab.engine.forward_path.current`). `lm_head=False` skips the LM head (DoLa applies it
    itself) and implies hidden states."""
    hidden_states = hidden_states or not lm_head
    options = {"attention_mask": attention_mask, "position_ids": position_ids, "output_hidden_states": hidden_states}
    path = forward_path.current(loaded)  # fixed for the run (lab.engine.forward_path)
    if path.lean:  # transformers' arithmetic without its per-module dispatch (lab.engine.lean_forward)
        options |= {"logits_to_keep": logits_to_keep, "lm_head": lm_head, "native": path.native}
        return lean_forward(loaded.model, input_ids, cache, **options)
    if not lm_head:
        out = loaded.model.get_decoder()(input_ids=input_ids, cache=cache, use_cache=True, **options)
        return None, out.hidden_states
    out = loaded.model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=logits_to_keep, **options)
    return out.logits, (out.hidden_states if hidden_states else None)


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
    logits, hidden = model_forward(
        loaded,
        input_ids,
        state.cache,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=1 if last_only else 0,
        hidden_states=hidden_states,
    )
    state.forwards += 1
    state.tokens.extend(token_ids)
    return ForwardOutput(logits[0].float(), tuple(h[0] for h in hidden) if hidden_states else None)  # [T, V]


@torch.inference_mode()
def forward_hidden(state: DecodeState, token_ids: list[int]) -> tuple[torch.Tensor, ...]:
    """`forward` without the LM head: run `token_ids` after the cached prefix (appending their KV, one counted
    forward) and return each layer's hidden state at the LAST position, (L + 1) x [H] ([L] is through the final
    norm). For callers that apply the head themselves (DoLa: the final and the early layers in one matmul)."""
    input_ids = torch.tensor([token_ids], dtype=torch.long, device=state.loaded.device)  # [1, T]
    _, hidden = model_forward(state.loaded, input_ids, state.cache, lm_head=False)
    state.forwards += 1
    state.tokens.extend(token_ids)
    return tuple(h[0, -1] for h in hidden)


@torch.inference_mode()
def forward_rows(
    state: DecodeState, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    """One forward of a batch of rows (input_ids [B, T], 2D padding mask [B, T_past + T], positions [B, T])
    after the cached past; returns the float32 last-position logits [B, V] and counts one forward. The caller
    keeps `state.tokens` (which row's tokens it records is its choice)."""
    logits, _ = model_forward(
        state.loaded, input_ids, state.cache, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=1
    )
    state.forwards += 1
    return logits[:, -1].float()  # [B, V]


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


@torch.inference_mode()
def decode_steps(states: list[DecodeState], token_ids: list[int]) -> torch.Tensor:
    """One token into each of B sequences (`token_ids[b]` after `states[b]`): float32 next-token logits [B, V], row
    b bit for bit what `decode_step(states[b], token_ids[b])` returns. On the native path one forward runs them
    all (`lab.engine.lean_forward.lean_steps`: the products over the B rows at once, each sequence attending to
    its own cache); elsewhere each sequence steps alone. Counts one forward per sequence."""
    if len(states) != len(token_ids) or not states:
        raise ValueError("decode_steps needs one token per sequence, and at least one sequence")
    loaded = states[0].loaded
    if len(states) > 1 and forward_path.current(loaded).native:
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=loaded.device)[:, None]  # [B, 1]
        logits = lean_steps(loaded.model, input_ids, [state.cache for state in states])
        if logits is not None:
            for state, token in zip(states, token_ids, strict=True):
                state.forwards += 1
                state.tokens.append(token)
            return logits[:, -1].float()
    return torch.cat([decode_step(state, token).logits for state, token in zip(states, token_ids, strict=True)])


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


@torch.inference_mode()  # the cache holds inference tensors, written in place below
def select(state: DecodeState, positions: list[int]) -> None:
    """Keep only the cache positions `positions` (ascending, e.g. prefix + an accepted tree path), in that order.

    Positions already in place (the prefix, and a path that follows the tree's first nodes) stay where they are:
    only the entries after the first moved one are copied, into the cache's own tensors (every forward leaves fresh
    tensors in the cache, so no other object sees the write), then the cache is cropped."""
    ascending = all(a < b for a, b in zip(positions, positions[1:], strict=False))
    if not ascending or (positions and positions[-1] >= state.length):
        raise ValueError(f"cache positions to keep must ascend below {state.length}: {positions}")
    in_place = next((i for i, p in enumerate(positions) if p != i), len(positions))
    with section("KV compaction"):
        if in_place < len(positions):
            index = torch.tensor(positions[in_place:], dtype=torch.long, device=state.loaded.device)
            for layer in state.cache.layers:  # [B, heads, T, d]
                layer.keys[..., in_place : len(positions), :] = layer.keys.index_select(-2, index)
                layer.values[..., in_place : len(positions), :] = layer.values.index_select(-2, index)
        state.cache.crop(len(positions) - state.length)
    state.tokens[:] = [state.tokens[p] for p in positions]
