"""The verifier of speculative decoding: one target forward over a chain draft, then the acceptance rule.

`verify_draft` runs the target once over [x_0, x_1..x_gamma] (x_0 = the last committed token, not yet in the
target's cache), builds p_i for i = 0..gamma with the same processors the plain sampler uses
(`process_logits`, then `target_distribution`: one-hot argmax in greedy mode), applies
`lab.sampling.accept_draft` (Leviathan et al. 2023, Alg. 1: accept x_i with probability min(1, p_i(x_i) /
q_i(x_i)), resample the first rejection from norm(max(0, p_i - q_i)), bonus from p_gamma when all pass) and
crops the target cache back to the committed prefix plus the accepted tokens (`lab.runtime.crop`).
The repetition penalty depends on the tokens before each position, so row i is processed with the history
plus x_1..x_i, exactly what the plain sampler would see after those tokens.
Greedy mode (a speed detail, same decisions): p and q are one-hot, so every nonzero entry lies in the support
S = {x_1..x_gamma} U {argmax p_i}; `accept_draft` runs on those |S| columns only (`Verification.support` maps
them back to token ids) instead of the whole vocabulary. Every ratio is 0 or 1 and every residual one-hot, so
the accepted tokens, the recovered and the bonus token are exactly those of the full-vocabulary call.
Not covered: tree drafts (`lab.runtime.verify_tree` serves those), typical acceptance.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from lab import runtime
from lab.proposers.base import Draft
from lab.sampling import Acceptance, SamplingConfig, accept_draft, process_logits, target_distribution


@dataclass(frozen=True)
class Verification:
    """The outcome of one verified round, with the tensors the strategy reports from. p and q share columns:
    the whole vocabulary, or in greedy mode the token ids listed in `support`."""

    acceptance: Acceptance  # in token ids
    processed: torch.Tensor  # [gamma + 1, V] processed target logits, row i after x_1..x_i
    p: torch.Tensor  # [gamma + 1, C] target distributions used by the acceptance rule
    q: torch.Tensor  # [gamma, C] draft distributions (one-hot at x_i for a deterministic drafter)
    support: list[int] | None  # token id of each column, None = column c is token c
    verify_s: float  # seconds: target forward, processors and acceptance

    def token(self, column: int) -> int:
        """The token id of a column of p and q."""
        return column if self.support is None else self.support[column]


def process_rows(logits: torch.Tensor, config: SamplingConfig, history: list[int], draft: list[int]) -> torch.Tensor:
    """Apply the processors to each verified row [n, V]; row i sees history + draft[:i]."""
    if config.repetition_penalty == 1.0:  # position independent: one batched call
        return process_logits(logits, config, [])
    rows = [process_logits(logits[i], config, history + draft[:i]) for i in range(logits.shape[0])]
    return torch.stack(rows)  # [n, V]


def _one_hot(columns: list[int], size: int, like: torch.Tensor) -> torch.Tensor:
    rows = torch.zeros(len(columns), size, dtype=torch.float32, device=like.device)  # [n, C]
    return rows.scatter_(1, torch.tensor(columns, dtype=torch.long, device=like.device)[:, None], 1.0)


def _distributions(
    processed: torch.Tensor, draft: Draft, config: SamplingConfig
) -> tuple[torch.Tensor, torch.Tensor, list[int] | None]:
    """(p, q, support): full-vocabulary rows, or in greedy mode one-hot rows over the support S."""
    if not config.greedy:
        p = target_distribution(processed, config)  # [gamma + 1, V]
        q = draft.q_draft.to(p) if draft.q_draft is not None else _one_hot(draft.tokens, p.shape[-1], p)
        return p, q, None
    argmax = processed.argmax(dim=-1).tolist()  # [gamma + 1]
    support = sorted(set(argmax) | set(draft.tokens))
    column = {token: c for c, token in enumerate(support)}
    p = _one_hot([column[t] for t in argmax], len(support), processed)  # [gamma + 1, |S|]
    q = _one_hot([column[t] for t in draft.tokens], len(support), processed)  # [gamma, |S|]
    return p, q, support


def _accept_on_support(
    p: torch.Tensor, q: torch.Tensor, tokens: list[int], support: list[int], generator: torch.Generator
) -> Acceptance:
    """`accept_draft` on the support columns, with the result mapped back to token ids."""
    column = {token: c for c, token in enumerate(support)}
    result = accept_draft(p, q, [column[t] for t in tokens], generator)
    recovered = None if result.recovered is None else support[result.recovered]
    bonus = None if result.bonus is None else support[result.bonus]
    accepted = [support[c] for c in result.accepted]
    return dataclasses.replace(result, accepted=accepted, recovered=recovered, bonus=bonus)


def verify_draft(
    target: runtime.DecodeState,
    last_token: int,
    draft: Draft,
    config: SamplingConfig,
    history: list[int],
    generator: torch.Generator,
) -> Verification:
    """Verify a chain draft in one target forward and roll the target cache back to what was kept.

    `history` is every committed token (prompt + generated, ending with `last_token`); the target cache holds
    all of them but `last_token` on entry, and all of them plus the accepted draft tokens on return.
    """
    if draft.tree is not None:
        raise ValueError("verify_draft verifies chains; tree drafts go through lab.runtime.verify_tree")
    start = time.perf_counter()
    n_past = target.length
    logits = runtime.verify(target, [last_token, *draft.tokens]).logits  # [gamma + 1, V]
    processed = process_rows(logits, config, history, draft.tokens)  # [gamma + 1, V]
    p, q, support = _distributions(processed, draft, config)
    if support is None:
        acceptance = accept_draft(p, draft.q_draft, draft.tokens, generator)
    else:
        acceptance = _accept_on_support(p, q, draft.tokens, support, generator)
    runtime.crop(target, n_past + 1 + len(acceptance.accepted))
    return Verification(acceptance, processed, p, q, support, time.perf_counter() - start)
