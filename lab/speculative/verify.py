"""The verifier: one target forward over the root and a chain or tree draft, the processed target logits of every
row, and the KV-cache commit of what was accepted.

Row 0 of the forward follows the root (the last committed token, not yet in the target's cache); row 1 + i follows
draft node i. A chain runs causally (`runtime.verify`); a tree runs with the tree attention mask and position ids
n_past + depth (`runtime.verify_tree`, docs/architecture.md section 4). The rows go through the same logits processors
as the plain sampler: with a repetition penalty, row 1 + i sees the history plus the tokens on the path to node i, which
is exactly what the plain sampler would see after them. `commit` keeps the root and the accepted path in the
cache: a crop for chains, `runtime.select` for trees (KV compaction).
The forward runs under `lab.engine.invariance.rows_invariant`, so on a CPU (bf16 / fp16, and float32 where MKL's
strict mode is on) every row is computed exactly as a one-token decode step would compute it, at any thread count,
and greedy verification decides exactly as greedy decoding does in the dtype the user runs.
Not covered: batched verification of several sequences.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from lab.engine import runtime
from lab.engine.invariance import rows_invariant
from lab.engine.sampling import SamplingConfig, process_logits
from lab.engine.tree_attention import build_tree_attention
from lab.speculative.acceptance import Acceptance
from lab.speculative.draft import Draft


@dataclass(frozen=True)
class Verification:
    processed: torch.Tensor  # [n + 1, V] processed target logits, row 0 after the root
    features: torch.Tensor | None  # [n + 1, F] the requested hidden states, concatenated, or None
    n_past: int  # cache length before the forward (the root's position)
    verify_s: float  # seconds: the forward and the processors


def process_rows(logits: torch.Tensor, config: SamplingConfig, history: list[int], draft: Draft) -> torch.Tensor:
    """Apply the processors to each verified row [n + 1, V]; row 1 + i sees history + the path to node i."""
    if config.repetition_penalty == 1.0:  # position independent: one batched call
        return process_logits(logits, config, [])
    parents, paths = draft.tree_parents, []
    for i, token in enumerate(draft.tokens):
        paths.append((paths[parents[i]] if parents[i] >= 0 else []) + [token])
    rows = [process_logits(logits[0], config, history)]
    rows += [process_logits(logits[i + 1], config, history + path) for i, path in enumerate(paths)]
    return torch.stack(rows)  # [n + 1, V]


def features_of(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...]) -> torch.Tensor:
    """The hidden states a proposer reads, concatenated along the feature axis: [T, len(layers) * H]."""
    return torch.cat([hidden_states[layer] for layer in layers], dim=-1)


def verify(
    state: runtime.DecodeState,
    root: int,
    draft: Draft,
    config: SamplingConfig,
    history: list[int],
    feature_layers: tuple[int, ...] = (),
) -> Verification:
    """Score [root] + draft in one target forward (chain: causal; tree: tree mask), process every row."""
    start, n_past, ids = time.perf_counter(), state.length, [root, *draft.tokens]
    hidden = bool(feature_layers)
    with rows_invariant(state.loaded):
        if draft.is_chain:
            out = runtime.verify(state, ids, hidden_states=hidden)
        else:
            tree = build_tree_attention([-1] + [p + 1 for p in draft.tree_parents])
            out = runtime.verify_tree(state, tree, ids, hidden_states=hidden)
    processed = process_rows(out.logits, config, history, draft)  # [n + 1, V]
    features = features_of(out.hidden_states, feature_layers) if hidden else None
    return Verification(processed, features, n_past, time.perf_counter() - start)


def commit(state: runtime.DecodeState, v: Verification, draft: Draft, acceptance: Acceptance) -> None:
    """Keep the root and the accepted path in the target's cache, drop every other draft entry."""
    if draft.is_chain:
        runtime.crop(state, v.n_past + 1 + len(acceptance.path))
    else:
        runtime.select(state, list(range(v.n_past + 1)) + [v.n_past + 1 + i for i in acceptance.path])


def path_rows(acceptance: Acceptance) -> list[int]:
    """Rows of the verify forward at the root and the accepted nodes (their features feed the next draft)."""
    return [0] + [1 + i for i in acceptance.path]
