"""Medusa (Cai et al. 2024): K heads draft a sparse candidate tree, one target forward verifies it all.

Each round: 1. the heads read h, the target's hidden state at the last committed token's predecessor row, and
`tree_from_choices` builds the tree (the first `tree_nodes` paths of the tuned `choices`, clipped to the
remaining budget); 2. `lab.speculative.verify` scores [root] + nodes with the tree attention mask (the root is the
last committed token, not yet in the KV cache); 3. acceptance picks a root-to-node path and the next token;
4. `commit` keeps the KV of the prefix and the path (compaction); 5. a `TreeRound` and one
`TokenEmitted` per token stream out; the next token becomes the new root and the path's last hidden state
feeds the heads. The first token comes from the prefill forward (like greedy).
Acceptance modes:
- greedy (exact): follow the child equal to the target's argmax (`lab.speculative.acceptance`); the output
  equals greedy decoding token for token, in fp32 and in bf16 (`lab.engine.invariance`);
- typical (lossy, Cai et al. 2024, Sec. 2.3.1): node x is accepted if p(x) > min(epsilon, delta * exp(-H(p)))
  under its parent's temperature-scaled target distribution; the longest accepted path wins (first in node order
  on ties) and the next token is sampled from p after it. Faster, but not the target's distribution;
- sample (lossless): `accept_tree_sampled`'s sibling-by-sibling rule for deterministic candidates (SpecInfer /
  EAGLE-2): accept child x with probability p(x), else p(x) = 0, renormalise, try the next sibling, finally
  sample what is left. A drafter that samples a chain with known q (MTPC) gets Leviathan et al.'s rule.
Tree size (`tree_nodes`, default 4, shared with MTPC) is a CPU trade-off (docs/benchmarks.md has the current
figures): a verify forward costs more per node on a CPU, while on a GPU larger trees are nearly free. At the CPU's
default precision (w4a8) 4 nodes ran faster than 8 and 2 faster still; 4 keeps a tree to look at.
The loop is `lab.speculative.tree.tree_loop`, the drafter `lab.speculative.proposers.medusa.MedusaProposer`.
`heads_path` also takes FasterDecoding's Medusa heads (a folder or Hub id: lab.heads.published), each head with
its own output layer over the full vocabulary.
Not covered: repetition penalty (it would depend on each node's path), batching, Medusa-2.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lab.engine.models import LoadedModel
from lab.heads import published_build
from lab.heads.medusa import MedusaHeads
from lab.heads.published import is_lab_stem
from lab.registry import Strategy
from lab.speculative.params import HeadTreeParams, tree_settings
from lab.speculative.proposers import cached_heads
from lab.speculative.proposers.medusa import MedusaProposer
from lab.speculative.tree import tree_loop
from lab.trace import Event


@dataclass(frozen=True)
class TreeParams(HeadTreeParams):
    """Medusa's settings (shared with MTPC: `lab.speculative.params.HeadTreeParams`)."""


def run(loaded: LoadedModel, prompt_ids: list[int], params: TreeParams, generator: torch.Generator) -> Iterator[Event]:
    if params.heads_path and not is_lab_stem(params.heads_path):  # FasterDecoding's layout (lab.heads.published)
        heads = published_build.cached("medusa", loaded, params.heads_path)
    else:
        heads = cached_heads("medusa", loaded, params.heads_path, lambda t, c: MedusaHeads.served(loaded, t, c))
    proposer = MedusaProposer(heads, params.tree_nodes)
    return tree_loop(loaded, prompt_ids, proposer, generator, tree_settings(params, "medusa"))


STRATEGY = Strategy(
    name="medusa",
    family="multi-token heads",
    summary="K extra heads guess tokens t+2..t+K+1; a candidate tree of their top-k is verified in one forward.",
    paper="Cai et al. 2024, Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads",
    Params=TreeParams,
    run=run,
)
