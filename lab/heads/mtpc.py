"""MTPC: multi-token prediction with a probabilistic circuit (Grivas et al. 2025), a mixture of r fully factorised
components over the next K + 1 tokens:
    P(x_{t+1}, .., x_{t+K+1} | h_t) = sum_z pi_z(h_t) prod_{k=0..K} p_{k,z}(x_{t+k+1} | h_t)
with pi = softmax(W_pi h + b_pi). r = 1 is the independent (Medusa-like) baseline. Position k = 0 is the base
model's own next token: p_{0,z} = softmax(W_lm[V_d] (h + B_0z SiLU(A_0z h))), so once the target has chosen
x_{t+1} (the root of the draft tree) the posterior w_z ∝ pi_z p_{0,z}(x_{t+1}) already says which component
fits. Positions k = 1..K use Medusa's residual block u_k = h + SiLU(W_k h + b_k) plus a per-(k, z) rank-rho
residual adapter: p_{k,z} = softmax(W_lm[V_d] (u_k + B_kz SiLU(A_kz u_k))). Since W_lm is linear, the logits are
W_lm u_k + (W_lm B_kz) s_kz, so a component costs one [V_d, rho] product on top of the shared per-position one
(cost comparable to Medusa's K heads).
Drafting from the joint (tractable marginals of the circuit): after the prefix x_1..x_{k-1} below the root,
    w_z(prefix) ∝ pi_z p_{0,z}(root) prod_{j<k} p_{j,z}(x_j),   q_k(x | prefix) = sum_z w_z(prefix) p_{k,z}(x).
Greedy trees use the same `choices` shape as Medusa, with node ranks taken under q_k(. | parent's prefix);
sampling draws a chain from these conditionals (its q rows are exact, so Leviathan's rule is lossless).
Deliberate differences from the paper: the shared frozen LM head restricted to V_d (as for Medusa here); low-rank
per-component adapters instead of separate per-component heads; components also cover the already-known next
token (position 0) to condition the mixture on it. Not covered: HMM-style circuits, fine-tuning the base model.
On a CPU target with low-bit linears the circuit's leaves are served on the target's kernels, as Medusa's heads
(`lab.heads.medusa.serving_path`): the blocks as one low-bit linear, and the logits of every (k, z) as the target's
low-bit LM-head rows applied once to u_k + B_kz SiLU(A_kz u_k) for all (K + 1) r leaves (the same W_lm(u + B s) as
W_lm u + (W_lm B) s, rounded otherwise; drafting only, verification is unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch.nn import functional as F

from lab.engine.models import LoadedModel
from lab.heads.medusa import LowBitPath, Path, residual_blocks, serving_path


def mtpc_logits(h: torch.Tensor, t: dict[str, torch.Tensor], lm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi [N, r], logits [N, K + 1, r, V_d]) of the circuit's leaves for hidden states h [N, H] (training;
    `MTPCHeads.leaves` is the same computation for one h with W_lm B_kz precomputed)."""
    u = torch.cat([h[:, None], residual_blocks(h, t["blocks.weight"], t["blocks.bias"])], dim=1)  # [N, K + 1, H]
    s = F.silu(torch.einsum("nkh,kzrh->nkzr", u, t["adapters.down"]))  # [N, K + 1, r, rho]
    corrections = torch.einsum("vh,kzhr->kzvr", lm, t["adapters.up"])  # [K + 1, r, V_d, rho]
    logits = (u @ lm.T)[:, :, None, :] + torch.einsum("nkzr,kzvr->nkzv", s, corrections)
    log_pi = torch.log_softmax(h @ t["mix.weight"].T + t["mix.bias"], dim=-1)
    return log_pi, logits


def init_tensors(heads: int, components: int, rank: int, hidden: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Zero blocks (every position starts as the LM head), random down-projections, small random up-projections
    (components start slightly apart: KL about 0.1 nat between two of them on the embedded model) and near-zero
    mixture weights (pi about uniform); without the random up-projections the components stay identical."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "blocks.weight": torch.zeros(heads, hidden, hidden),
        "blocks.bias": torch.zeros(heads, hidden),
        "adapters.down": torch.randn(heads + 1, components, rank, hidden, generator=generator) / hidden**0.5,
        "adapters.up": torch.randn(heads + 1, components, hidden, rank, generator=generator) * 0.03,
        "mix.weight": torch.randn(components, hidden, generator=generator) * 0.01,
        "mix.bias": torch.zeros(components),
    }


@dataclass
class MTPCHeads:
    """A trained circuit bound to the base model's LM-head rows V_d (inference only): float32 products, or the
    target's low-bit kernels where `low_bit` is set (`served`)."""

    tensors: dict[str, torch.Tensor]
    vocab: torch.Tensor  # [V_d]
    lm_weight: torch.Tensor  # [V_d, H]
    choices: list[Path] = field(default_factory=list)
    low_bit: LowBitPath | None = None  # the products on the target's low-bit kernels (module docstring)

    def __post_init__(self) -> None:
        self.remap = {int(v): i for i, v in enumerate(self.vocab.tolist())}

    @cached_property
    def corrections(self) -> torch.Tensor:
        """(W_lm B_kz)^T [K + 1, r, rho, V_d], made once, so a float round costs one [rho, V_d] product per
        component."""
        with torch.inference_mode():
            up = self.tensors["adapters.up"]  # [K + 1, r, H, rho]
            return (up.transpose(-1, -2) @ self.lm_weight.T).contiguous()

    @property
    def num_heads(self) -> int:
        return int(self.tensors["blocks.weight"].shape[0])

    @property
    def components(self) -> int:
        return int(self.tensors["mix.bias"].shape[0])

    @classmethod
    def from_tensors(cls, lm_head_weight: torch.Tensor, tensors: dict, config: dict) -> MTPCHeads:
        vocab = tensors["vocab"].long()
        lm_weight = lm_head_weight.detach().float().index_select(0, vocab.to(lm_head_weight.device))
        floats = {name: value.float() for name, value in tensors.items() if name != "vocab"}
        choices = [tuple(int(i) for i in path) for path in config.get("choices", [])]
        return cls(floats, vocab, lm_weight, choices)

    @classmethod
    def served(cls, loaded: LoadedModel, tensors: dict, config: dict) -> MTPCHeads:
        """The circuit as the strategy runs it on `loaded`: on its low-bit kernels where it has them."""
        heads = cls.from_tensors(loaded.lm_head.weight, tensors, config)
        heads.low_bit = serving_path(heads.tensors["blocks.weight"], heads.tensors["blocks.bias"], heads.vocab, loaded)
        return heads

    @torch.inference_mode()
    def leaves(self, h: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(log pi [r], log p_{k,z} [K + 1, r, V_d]) at hidden state h [H]; logits scaled by 1 / temperature."""
        t, low_bit = self.tensors, self.low_bit
        blocks = (
            low_bit.residual_blocks(h[None])
            if low_bit
            else residual_blocks(h.float()[None], t["blocks.weight"], t["blocks.bias"])
        )
        h = h.float()
        u = torch.cat([h[None], blocks[0]])  # [K + 1, H]
        s = F.silu(torch.einsum("kh,kzrh->kzr", u, t["adapters.down"]))  # [K + 1, r, rho]
        if low_bit is not None:  # W_lm (u_k + B_kz s_kz) for every leaf in one product
            logits = low_bit.logits(u[:, None, :] + torch.einsum("kzr,kzhr->kzh", s, t["adapters.up"]))
        else:
            logits = (u @ self.lm_weight.T)[:, None, :] + (s[:, :, None, :] @ self.corrections)[:, :, 0, :]
        log_pi = torch.log_softmax(t["mix.weight"] @ h + t["mix.bias"], dim=-1)  # [r]
        return log_pi, torch.log_softmax(logits / temperature, dim=-1)  # [K + 1, r, V_d]


class Circuit:
    """The conditionals of one round's circuit, given the root token (Grivas et al. 2025, tractable marginals)."""

    def __init__(self, heads: MTPCHeads, log_pi: torch.Tensor, logp: torch.Tensor, root: int) -> None:
        self.logp = logp  # [K + 1, r, V_d]
        index = heads.remap.get(root)
        self.root_weights = log_pi + (logp[0, :, index] if index is not None else 0.0)
        self.root_weights = self.root_weights - torch.logsumexp(self.root_weights, 0)  # log w_z(root)
        self.cache: dict[tuple[int, ...], torch.Tensor] = {(): self.root_weights}
        self.probs: dict[int, torch.Tensor] = {}  # k -> p_{k,z}(.) = exp(log p_{k,z}), made when first read

    def p(self, k: int) -> torch.Tensor:
        """p_{k,z}(.) for every component z. [r, V_d]"""
        if k not in self.probs:
            self.probs[k] = self.logp[k].exp()
        return self.probs[k]

    def log_weights(self, prefix: tuple[int, ...]) -> torch.Tensor:
        """log w_z(prefix) ∝ log pi_z + log p_0z(root) + sum_j log p_{j,z}(x_j); prefix in V_d indices. [r]"""
        if prefix not in self.cache:
            w = self.log_weights(prefix[:-1]) + self.logp[len(prefix), :, prefix[-1]]
            self.cache[prefix] = w - torch.logsumexp(w, 0)
        return self.cache[prefix]

    def conditional(self, prefix: tuple[int, ...]) -> torch.Tensor:
        """q_k(. | prefix) = sum_z w_z(prefix) p_{k,z}, k = len(prefix) + 1. [V_d]

        Summed in probability space, as the formula reads (a product of the r weights and the [r, V_d] rows): the
        weights are normalised in log space and every term lies in [0, 1], so nothing over- or underflows that a
        log-sum-exp over the components would keep, and it costs a matrix-vector product instead of a strided
        reduction over r x V_d exponentials per node."""
        return self.log_weights(prefix).exp() @ self.p(len(prefix) + 1)

    def marginals(self) -> torch.Tensor:
        """q_k(.) given only the root, for k = 1..K (the per-head heatmap). [K, V_d]"""
        w = self.root_weights.exp()
        return torch.stack([w @ self.p(k) for k in range(1, self.logp.shape[0])])

    def sample_chain(self, depth: int, generator: torch.Generator) -> tuple[list[int], torch.Tensor]:
        """Ancestral sample x_1..x_depth from the joint; returns V_d indices and the rows q_k(. | x_<k). [depth, V_d]"""
        prefix: tuple[int, ...] = ()
        rows = []
        for _ in range(depth):
            q = self.conditional(prefix)
            rows.append(q)
            prefix = prefix + (int(torch.multinomial(q, 1, generator=generator)),)
        return list(prefix), torch.stack(rows) if rows else self.logp.new_zeros(0, self.logp.shape[-1])

    def pairs(self, top: int = 6) -> tuple[list[tuple[int, int]], list[float], list[float]]:
        """Candidate pairs of the first two draft positions: joint sum_z w_z p_1z(a) p_2z(b) vs q_1(a) q_2(b)."""
        w = self.root_weights.exp()  # [r]
        p1, p2 = self.p(1), self.p(2)  # [r, V_d]
        q1, q2 = w @ p1, w @ p2
        top = min(top, q1.numel())
        a, b = torch.topk(q1, top).indices, torch.topk(q2, top).indices
        joint = torch.einsum("z,za,zb->ab", w, p1[:, a], p2[:, b])  # [top, top]
        product = q1[a][:, None] * q2[b][None, :]
        order = torch.argsort(-(joint + product).flatten())[: top + 2].tolist()
        cells = [(i // top, i % top) for i in order]
        pairs = [(int(a[i]), int(b[j])) for i, j in cells]
        return pairs, [float(joint[i, j]) for i, j in cells], [float(product[i, j]) for i, j in cells]
