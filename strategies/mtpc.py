"""MTPC (Grivas et al. 2025): draft from a mixture-of-components circuit over the next K tokens, verify as a tree.

The loop, verification, KV compaction and acceptance rules are the tree loop's (`lab.speculative.tree`), shared
with Medusa; only the proposer differs (`lab.speculative.proposers.mtpc`): greedy / typical trees follow the
circuit's conditionals q_k(. | root, prefix), sampling draws a chain from the joint with exact q rows and accepts
it with Leviathan et al.'s rule (lossless). Each round also emits a `MixtureRound`.
Not covered: HMM circuits, repetition penalty.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lab.engine.models import LoadedModel
from lab.heads.mtpc import MTPCHeads
from lab.registry import Strategy
from lab.speculative.params import HeadTreeParams, tree_settings
from lab.speculative.proposers import cached_heads
from lab.speculative.proposers.mtpc import MTPCProposer
from lab.speculative.tree import tree_loop
from lab.trace import Event


@dataclass(frozen=True)
class MTPCParams(HeadTreeParams):
    """MTPC's settings (the same as Medusa's: `lab.speculative.params.HeadTreeParams`)."""


def run(loaded: LoadedModel, prompt_ids: list[int], params: MTPCParams, generator: torch.Generator) -> Iterator[Event]:
    heads = cached_heads("mtpc", loaded, params.heads_path, lambda t, c: MTPCHeads.served(loaded, t, c))
    temperature = params.temperature if params.mode == "sample" else None
    proposer = MTPCProposer(heads, params.tree_nodes, temperature, loaded.vocab_size)
    return tree_loop(loaded, prompt_ids, proposer, generator, tree_settings(params, "mtpc"))


STRATEGY = Strategy(
    name="mtpc",
    family="multi-token heads",
    summary="A mixture of factorised components models the next K tokens jointly; drafts follow its conditionals.",
    paper="Grivas et al. 2025, Fast and Expressive Multi-Token Prediction with Probabilistic Circuits (MTPC)",
    Params=MTPCParams,
    run=run,
)
