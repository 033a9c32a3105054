"""Sampling: logits processors and `sample` (docs/architecture.md section 5).

Every function is pure (inputs are never modified) and every random draw comes from an explicit
`torch.Generator`. Processors follow Hugging Face's semantics and order (repetition penalty, then temperature,
top-k, top-p, min-p) so a seeded run is comparable with `model.generate`.
The speculative acceptance rules (Leviathan et al. 2023, Alg. 1 and the tree rules) are in
`lab.speculative.acceptance`. Not covered: batched sampling over several sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lab.engine import native_forward

FILTERED = float("-inf")


@dataclass(frozen=True)
class SamplingConfig:
    """Settings of the processor chain; temperature 0 means greedy (argmax)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # written positively so NaN fails too
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not self.top_k >= 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_repetition_penalty(logits: torch.Tensor, previous_ids: list[int], penalty: float) -> torch.Tensor:
    """CTRL (Keskar et al. 2019): seen tokens' logits divided by `penalty` if positive, multiplied if negative."""
    if penalty == 1.0 or not previous_ids:
        return logits
    index = torch.tensor(sorted(set(previous_ids)), device=logits.device)
    seen = logits.index_select(-1, index)
    penalized = torch.where(seen < 0, seen * penalty, seen / penalty)
    return logits.index_copy(-1, index, penalized)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(z / T): T < 1 sharpens, T > 1 flattens. T must be > 0 (T = 0 is greedy, handled by `sample`)."""
    return logits if temperature in (0.0, 1.0) else logits / temperature


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits (ties at the k-th value kept, as in HF); k = 0 keeps all."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, FILTERED)


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus (Holtzman et al. 2020): keep the smallest set of top tokens whose probability reaches top_p."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[..., -1:] = False  # always keep the most likely token
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, FILTERED)


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Min-p (Nguyen et al. 2024): drop tokens with p < min_p * p_max."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, FILTERED)


def process_logits(logits: torch.Tensor, config: SamplingConfig, previous_ids: list[int]) -> torch.Tensor:
    """The whole chain in HF order; returns new logits whose softmax is the distribution sampled from."""
    logits = apply_repetition_penalty(logits, previous_ids, config.repetition_penalty)
    if config.greedy:
        return logits
    logits = apply_temperature(logits, config.temperature)
    logits = apply_top_k(logits, config.top_k)
    logits = apply_top_p(logits, config.top_p)
    return apply_min_p(logits, config.min_p)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from a probability vector [V] with the given generator."""
    return int(torch.multinomial(probs, 1, generator=generator))


def choose_token(processed_logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator) -> int:
    """argmax (the first maximal id, as torch.argmax) when greedy, otherwise a draw from softmax(processed_logits)."""
    if config.greedy:
        return int(top_tokens(processed_logits, 1).ids[0, 0])
    return sample(processed_logits.softmax(dim=-1), generator)


@dataclass(frozen=True)
class TopTokens:
    """The k largest logits of each row, largest first: a NaN above every number (as torch.topk and torch.argmax
    rank it), equal logits by token id, lowest first. So `ids[:, 0]` is each row's torch.argmax, and `ids` is what
    a stable descending sort of the row puts first."""

    ids: torch.Tensor  # [R, k] int64
    logits: torch.Tensor  # [R, k]


def top_tokens(logits: torch.Tensor, k: int) -> TopTokens:
    """The top k of each row of `logits` [..., V] (leading dims flattened: one row [V] gives R = 1), in `TopTokens`'
    order.

    A decoding round reads the greedy token and the alternatives a trace shows from the target's rows; on a CPU
    ATen's argmax and topk are two more passes over each row (topk a partial sort). The native op
    (lab/engine/native/row_top.cpp) finds both in one vectorized pass. Elsewhere (op not built, a GPU): k = 1 is
    torch.argmax; otherwise ATen's topk, its k ids put in this order, unless the k-th value also lies outside them
    (a tie across the cut, e.g. -inf after top-k filtering, or a NaN k-th): then the ids ranking above the k-th are
    sorted and the lowest ids equal to it fill the rest."""
    rows = logits.reshape(-1, logits.shape[-1])
    k = min(k, rows.shape[-1])
    if rows.device.type == "cpu" and rows.dtype == torch.float32 and native_forward.available():
        ids, values = torch.ops.decoding_lab.row_top(rows, k)
        return TopTokens(ids, values)
    if k == 1:
        ids = rows.argmax(-1, keepdim=True)  # the first maximal id, a NaN first
        return TopTokens(ids, rows.gather(1, ids))
    values, ids = torch.topk(rows, k, dim=-1)
    kth = values[:, -1:]
    if not kth.isnan().any() and torch.equal((rows == kth).sum(-1), (values == kth).sum(-1)):
        ids = ids.sort(dim=-1).values  # by id, then stably by value: equal values keep id order
        ids = ids.gather(1, torch.sort(rows.gather(1, ids), dim=-1, descending=True, stable=True).indices)
        return TopTokens(ids, rows.gather(1, ids))
    above = (rows.isnan() & ~kth.isnan()) | (rows > kth)
    tied = (rows == kth) | (rows.isnan() & kth.isnan())
    ids = []
    for row, higher, equal in zip(rows, above, tied, strict=True):
        index = higher.nonzero()[:, 0]  # ascending ids
        first = index[torch.sort(row[index], descending=True, stable=True).indices]
        ids.append(torch.cat([first, equal.nonzero()[: k - first.numel(), 0]]))
    ids = torch.stack(ids)
    return TopTokens(ids, rows.gather(1, ids))


def target_distribution(processed_logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """p used by speculative acceptance: softmax, or one-hot argmax in greedy mode (exact greedy equality)."""
    if config.greedy:
        best = top_tokens(processed_logits, 1).ids[:, 0].reshape(processed_logits.shape[:-1])
        return torch.nn.functional.one_hot(best, processed_logits.shape[-1]).float()
    return processed_logits.softmax(dim=-1)
