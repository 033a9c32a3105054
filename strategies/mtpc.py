"""MTPC (Grivas et al. 2025): draft from a mixture-of-components circuit over the next K tokens, verify as a tree.

The decode loop, verification, KV compaction and acceptance rules are Medusa's (`strategies.medusa.
tree_decode_loop`); only the drafter differs:
- greedy / typical: the candidate tree has the tuned `choices` shape, but a node's children are the top tokens of
  the circuit's conditional q_k(. | root, prefix) (`lab.heads.mtpc.Circuit`), so after "New" the circuit can
  prefer "York" where independent heads would still rank "Microsoft". Greedy output equals greedy decoding.
- sample (lossless): a chain x_1..x_K drawn ancestrally from the joint at temperature T; q_k = the circuit's
  conditional at each position (exact, tractable), accepted by Leviathan et al.'s rule (`accept_draft`), so the
  output is distributed as the target's p.
Each round also emits a `MixtureRound`: P(z | h), P(z | h, root) and the top pairs of the first two draft
positions under the joint vs the product of marginals. Not covered: HMM circuits, repetition penalty.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from lab.heads.medusa import DraftTree, head_top, prune_choices, tree_from_choices
from lab.heads.mtpc import Circuit, MTPCHeads, chain_tree
from lab.models import LoadedModel
from lab.trace import Event, MixtureRound
from strategies.base import Strategy
from strategies.medusa import TreeParams, cached_heads, tree_decode_loop


class MTPCDrafter:
    method = "mtpc"

    def __init__(self, heads: MTPCHeads, params: TreeParams, loaded: LoadedModel, step_start: int = 1) -> None:
        self.heads, self.params, self.loaded = heads, params, loaded
        self.eos = loaded.eos_token_ids
        self.step = step_start

    def draft(self, hidden, root, root_logits, max_depth, mode, generator) -> tuple[DraftTree, list[Event]]:
        temperature = self.params.temperature if mode == "sample" else 1.0
        log_pi, logp = self.heads.leaves(hidden, temperature)
        circuit = Circuit(self.heads, log_pi, logp, root)
        if mode == "sample":
            indices, rows = circuit.sample_chain(min(max_depth, self.heads.num_heads), generator)
            cut = next((i + 1 for i, x in enumerate(indices) if int(self.heads.vocab[x]) in self.eos), len(indices))
            tree = chain_tree(indices[:cut], rows[:cut], self.heads.vocab, self.loaded.vocab_size)
        else:
            choices = prune_choices(self.heads.choices, self.params.tree_nodes, max_depth, self.heads.num_heads)
            tree = tree_from_choices(choices, circuit.conditional, self.heads.vocab, self.eos)
        tree = DraftTree(**{**tree.__dict__, "head_top": head_top(circuit.marginals(), self.heads.vocab)})
        event = self.mixture_event(log_pi, circuit) if self.heads.num_heads >= 2 else None
        self.step += 1
        return tree, [event] if event else []

    def mixture_event(self, log_pi: torch.Tensor, circuit: Circuit) -> MixtureRound:
        pairs, joint, product = circuit.pairs()
        ids = [[int(self.heads.vocab[a]), int(self.heads.vocab[b])] for a, b in pairs]
        text = self.loaded.token_text
        return MixtureRound(
            step=self.step,
            prior=[round(x, 5) for x in log_pi.exp().tolist()],
            posterior=[round(x, 5) for x in circuit.root_weights.exp().tolist()],
            pair_ids=ids,
            pair_texts=[[text(a), text(b)] for a, b in ids],
            joint=[round(x, 6) for x in joint],
            product=[round(x, 6) for x in product],
        )


def run(loaded: LoadedModel, prompt_ids: list[int], params: TreeParams, generator: torch.Generator) -> Iterator[Event]:
    heads = cached_heads(
        "mtpc", loaded, params.heads_path, lambda t, c: MTPCHeads.from_tensors(loaded.lm_head.weight, t, c)
    )
    return tree_decode_loop(loaded, prompt_ids, params, MTPCDrafter(heads, params, loaded), generator)


STRATEGY = Strategy(
    name="mtpc",
    family="multi-token heads",
    summary="A mixture of factorised components models the next K tokens jointly; drafts follow its conditionals.",
    paper="Grivas et al. 2025, Fast and Expressive Multi-Token Prediction with Probabilistic Circuits (MTPC)",
    Params=TreeParams,
    run=run,
)
