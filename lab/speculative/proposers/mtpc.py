"""MTPC drafting (Grivas et al. 2025): the mixture-of-components circuit over the next K tokens
(`lab.heads.mtpc`) drafts from its joint instead of independent marginals.
- greedy / typical: the candidate tree has Medusa's tuned `choices` shape (`tree_from_choices`), but a node's
  children are the top tokens of the circuit's conditional q_k(. | root, prefix), so after "New" the circuit can
  prefer "York" where independent heads would still rank "Microsoft". Candidates are deterministic (q None).
- sample (lossless): a chain x_1..x_K drawn ancestrally from the joint at temperature T; q_k = the circuit's
  conditional at each position (exact, tractable), scattered to the full vocabulary on the logits' device, so
  Leviathan et al.'s rule keeps the output distributed as the target's p.
Each round also emits a `MixtureRound`: P(z | h), P(z | h, root) and the top pairs of the first two draft
positions under the joint vs the product of marginals. Not covered: HMM circuits, repetition penalty.
"""

from __future__ import annotations

import torch

from lab.heads.mtpc import Circuit, MTPCHeads
from lab.speculative.draft import Draft, DraftContext, Verified
from lab.speculative.proposers.medusa import head_top, prune_choices, tree_from_choices
from lab.trace import MixtureRound


def sampled_chain(indices: list[int], rows: torch.Tensor, vocab: torch.Tensor, vocab_size: int) -> Draft:
    """A chain drawn from the circuit, with its q rows scattered to the full vocabulary. rows [n, V_d]."""
    n = len(indices)
    full = rows.new_zeros(n, vocab_size)  # [n, V] on the rows' device
    full[:, vocab.to(rows.device)] = rows
    picked = rows[torch.arange(n, device=rows.device), torch.tensor(indices, dtype=torch.long, device=rows.device)]
    ranks = (rows > picked[:, None]).sum(-1).tolist() if n else []
    tokens = [int(vocab[x]) for x in indices]
    return Draft(tokens, None, full, picked.tolist(), ranks)


class MTPCProposer:
    """The circuit over the target's last feature (read from `accept`)."""

    name = "mtpc"
    feature_layers = (-1,)
    forwards = 0

    def __init__(self, heads: MTPCHeads, tree_nodes: int, sample_temperature: float | None, vocab_size: int) -> None:
        self.heads, self.tree_nodes, self.vocab_size = heads, tree_nodes, vocab_size
        self.sample_temperature = sample_temperature  # None: deterministic trees (greedy / typical)
        self.hidden: torch.Tensor | None = None

    def accept(self, verified: Verified) -> None:
        self.hidden = verified.features[-1]  # [H]
        self.root = verified.tokens[-1]

    def propose(self, context: DraftContext) -> Draft:
        heads, eos = self.heads, context.eos_token_ids
        temperature = self.sample_temperature or 1.0
        log_pi, logp = heads.leaves(self.hidden, temperature)
        circuit = Circuit(heads, log_pi, logp, self.root)
        if self.sample_temperature is not None:
            indices, rows = circuit.sample_chain(min(context.gamma, heads.num_heads), context.generator)
            cut = next((i + 1 for i, x in enumerate(indices) if int(heads.vocab[x]) in eos), len(indices))
            draft = sampled_chain(indices[:cut], rows[:cut], heads.vocab, self.vocab_size)
        else:
            choices = prune_choices(heads.choices, self.tree_nodes, context.gamma, heads.num_heads)
            draft = tree_from_choices(choices, circuit.conditional, heads.vocab, eos)
        top_ids, top_probs = head_top(circuit.marginals(), heads.vocab)
        events = (self.mixture_event(context, log_pi, circuit),) if heads.num_heads >= 2 else ()
        return Draft(draft.tokens, draft.parents, draft.q, draft.q_token, draft.ranks, top_ids, top_probs, events)

    def mixture_event(self, context: DraftContext, log_pi: torch.Tensor, circuit: Circuit) -> MixtureRound:
        pairs, joint, product = circuit.pairs()
        ids = [[int(self.heads.vocab[a]), int(self.heads.vocab[b])] for a, b in pairs]
        text = context.text_of
        return MixtureRound(
            step=context.step,
            prior=[round(x, 5) for x in log_pi.exp().tolist()],
            posterior=[round(x, 5) for x in circuit.root_weights.exp().tolist()],
            pair_ids=ids,
            pair_texts=[[text(a), text(b)] for a, b in ids],
            joint=[round(x, 6) for x in joint],
            product=[round(x, 6) for x in product],
        )

    def close(self) -> None:
        self.hidden = None
