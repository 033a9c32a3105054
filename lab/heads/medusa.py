"""Medusa heads (Cai et al. 2024, Sec. 2.1.1) and the sparse candidate tree they draft (Sec. 2.1.2).

Head k (k = 1..K) reads the base model's last hidden state h_t (after the final norm) and predicts token
x_{t+k+1}, k tokens beyond the base model's own next token x_{t+1}:
    p_t^(k) = softmax(W_lm[V_d] (h_t + SiLU(W_k h_t + b_k)))            (Cai et al. 2024, Eq. 1)
with W_k initialised to zero, so every head starts as the LM head itself.
Deliberate differences from the paper, to fit the lab's 25 MB budget and keep drafting cheap on a CPU:
- the output layer is the base model's frozen LM head, shared by all heads (Medusa trains a copy per head);
- it scores only V_d, a frequency-ranked draft vocabulary (FR-Spec / EAGLE-3 style, `lab.heads.common`);
  verification always scores the full vocabulary, so outputs stay exact.
The candidate tree is given by `choices`, a list of paths like Medusa's `medusa_choices`: path (i_1, .., i_d)
is a node at depth d whose token is rank i_d of head d, under the node of path (i_1, .., i_{d-1}); drafting is
`lab.speculative.proposers.medusa`.
`tune_choices` orders paths by their estimated acceptance probability, prod_j acc_j[i_j] (Medusa's greedy tree
construction, Sec. 3.3.2 / App. C), so the first N paths of the list are the best N-node tree.
On a CPU target with low-bit linears (int8 / int4 / w4a8) the heads are served on the target's kernels
(`serving_path`): the K blocks W_k as one low-bit linear H -> K H and the logits through the rows V_d of the target's
own low-bit LM head, so a round costs two row-efficient products instead of float32 ones over [K, H, H] and
[V_d, H]; the draft distribution changes by the weights' rounding, verification (and so the output) does not.
Not covered: Medusa-2 (joint fine-tuning of the base model), per-head LM-head copies, tree pruning at run time.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from lab.engine.models import LoadedModel
from lab.engine.quant import Int8Linear, W8A8Linear, quantized_linear

Path = tuple[int, ...]


def residual_blocks(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """u_k = h + SiLU(W_k h + b_k) for every head k at once: h [N, H], weight [K, H, H], bias [K, H] -> [N, K, H]."""
    return h[:, None, :] + F.silu(torch.einsum("nh,kgh->nkg", h, weight) + bias)


@dataclass
class LowBitPath:
    """The heads' two products on the target's low-bit kernels (module docstring; made by `serving_path`)."""

    blocks: nn.Module  # [N, H] -> [N, K * H]: W_k h + b_k of every head, the K matrices joined
    lm_rows: nn.Module  # [N, H] -> [N, V_d]: the rows V_d of the target's LM head, in its format
    dtype: torch.dtype  # the activation dtype of both

    def residual_blocks(self, h: torch.Tensor) -> torch.Tensor:
        """u_k = h + SiLU(W_k h + b_k) (Eq. 1) for every head: h [N, H] -> [N, K, H] float32."""
        z = self.blocks(h.to(self.dtype)).float().view(h.shape[0], -1, h.shape[-1])
        return h.float()[:, None, :] + F.silu(z)

    def logits(self, u: torch.Tensor) -> torch.Tensor:
        """W_lm[V_d] u over the last axis of u [..., H] -> [..., V_d] float32."""
        return self.lm_rows(u.to(self.dtype)).float()


def serving_path(
    weight: torch.Tensor, bias: torch.Tensor, vocab: torch.Tensor, loaded: LoadedModel
) -> LowBitPath | None:
    """The low-bit path for residual blocks (weight [K, H, H], bias [K, H]) over draft vocabulary `vocab`, when the
    target is a CPU model whose LM head is low-bit (int8 per channel, or Q8_0 blocks at w4a8); else None."""
    lm_head = loaded.lm_head
    if loaded.device.type != "cpu" or type(lm_head) not in (Int8Linear, W8A8Linear):
        return None
    heads, hidden = int(weight.shape[0]), int(weight.shape[-1])
    joined = nn.Linear(hidden, heads * hidden)
    with torch.no_grad():  # nn.Linear's weight is [out, in]: row k * H + g is W_k[g]
        joined.weight.copy_(weight.reshape(heads * hidden, hidden))
        joined.bias.copy_(bias.reshape(heads * hidden))
    blocks = quantized_linear(joined, loaded.precision, loaded.dtype)
    return LowBitPath(blocks, type(lm_head).rows(lm_head, vocab), loaded.dtype)


@dataclass
class MedusaHeads:
    """Trained Medusa heads bound to a base model's LM-head rows V_d (inference only): float32 products, or the
    target's low-bit kernels where `low_bit` is set (`served`)."""

    weight: torch.Tensor  # [K, H, H]
    bias: torch.Tensor  # [K, H]
    vocab: torch.Tensor  # [V_d] long, draft-vocabulary id -> model token id
    lm_weight: torch.Tensor  # [V_d, H] rows of the frozen LM head
    choices: list[Path] = field(default_factory=list)
    low_bit: LowBitPath | None = None  # the products on the target's low-bit kernels (`serving_path`)

    @property
    def num_heads(self) -> int:
        return int(self.weight.shape[0])

    @classmethod
    def from_tensors(cls, lm_head_weight: torch.Tensor, tensors: dict, config: dict) -> MedusaHeads:
        vocab = tensors["vocab"].long()
        lm_weight = lm_head_weight.detach().float().index_select(0, vocab.to(lm_head_weight.device))
        choices = [tuple(int(i) for i in path) for path in config.get("choices", [])]
        return cls(tensors["blocks.weight"].float(), tensors["blocks.bias"].float(), vocab, lm_weight, choices)

    @classmethod
    def served(cls, loaded: LoadedModel, tensors: dict, config: dict) -> MedusaHeads:
        """The heads as the strategy runs them on `loaded`: on its low-bit kernels where it has them."""
        heads = cls.from_tensors(loaded.lm_head.weight, tensors, config)
        heads.low_bit = serving_path(heads.weight, heads.bias, heads.vocab, loaded)
        return heads

    @torch.inference_mode()
    def probs(self, h: torch.Tensor) -> torch.Tensor:
        """p^(k) over V_d for each head: h [H] -> [K, V_d]."""
        if self.low_bit is not None:
            return torch.softmax(self.low_bit.logits(self.low_bit.residual_blocks(h[None])[0]), dim=-1)
        u = residual_blocks(h.float()[None], self.weight, self.bias)[0]  # [K, H]
        return torch.softmax(u @ self.lm_weight.T, dim=-1)  # [K, V_d]


def tune_choices(accuracy: list[list[float]], max_nodes: int = 64) -> list[Path]:
    """Medusa's tree construction: best-first over paths by estimated acceptance prod_j accuracy[j][i_j].

    accuracy[d][i] = P(the rank-i token of draft position d is the target's token | the prefix was right),
    measured on held-out data. The result lists paths best first; any prefix of it is a valid tree.
    """
    heap: list[tuple[float, Path]] = [(-accuracy[0][0], (0,))]
    chosen: list[Path] = []
    seen = {(0,)}
    while heap and len(chosen) < max_nodes:
        negative, path = heapq.heappop(heap)
        chosen.append(path)
        score = -negative
        depth = len(path) - 1
        candidates = [path[:-1] + (path[-1] + 1,)]  # next sibling
        if depth + 1 < len(accuracy):
            candidates.append(path + (0,))  # first child
        for nxt in candidates:
            d, rank = len(nxt) - 1, nxt[-1]
            if nxt in seen or rank >= len(accuracy[d]):
                continue
            parent_score = score if len(nxt) > len(path) else score / max(accuracy[depth][path[-1]], 1e-12)
            seen.add(nxt)
            heapq.heappush(heap, (-parent_score * accuracy[d][rank], nxt))
    return chosen


def rank_accuracy(ranks: torch.Tensor, max_rank: int) -> list[float]:
    """Share of rows whose true token has rank i (i < max_rank) in the drafter's distribution. ranks: [N]."""
    counts = torch.bincount(ranks.clamp(max=max_rank), minlength=max_rank + 1)[:max_rank].float()
    return [round(v, 5) for v in (counts / max(ranks.numel(), 1)).tolist()]
