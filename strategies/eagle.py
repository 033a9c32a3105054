"""EAGLE-2 (Li et al. 2024): the EAGLE feature-level draft head grows a dynamic draft tree, one target forward
verifies it.

The drafting (`lab.speculative.proposers.eagle`) and the loop (`lab.speculative.tree.tree_loop`) are shared code.
Each round: 1. the head reads the real pairs the last round committed (`EagleCache.extend`: the target's
features f at the root and the accepted nodes, paired with the tokens that followed them) and predicts f_hat
after the root; 2. EAGLE-2's dynamic tree (Sec. 4, "expansion" and "reranking"): the top-`branch` tokens of
q = softmax(W_lm[V_d] f_hat) are depth 0; at each further depth the `branch` frontier nodes with the highest
cumulative log-probability c(x) = sum of log q along the path (the draft's confidence, which EAGLE-2 shows
approximates the acceptance rate) are expanded at once (one head forward with the tree mask), each proposing
its top-`branch` children; after `depth` levels every candidate is reranked by c(x) and the best `total_tokens`
are kept (a child never outscores its parent, so the kept set is a tree); 3. `lab.speculative.verify` scores [root] +
nodes in one forward;
4. `lab.speculative.acceptance` keeps the longest accepted path: greedy (follow the target's argmax; exact)
or sample (EAGLE-2's sibling-by-sibling rule: accept child x with probability p(x), else set p(x) = 0,
renormalise and try the next sibling, finally sample what is left; lossless); 5. `commit` compacts the
target's KV cache to prefix + path, the head's cache drops its tree entries (`EagleCache.rollback`) and
re-reads the path with real features in step 1 of the next round, as EAGLE's implementation does;
6. an `EagleDraft` (every candidate, its score, the rerank cut), a `TreeRound` and one `TokenEmitted` per
token stream out. The first token comes from the prefill forward, as in greedy decoding.

Defaults (total_tokens 4, depth 2, branch 8) are the fastest tree measured for the embedded model at the CPU's
default precision (w4a8) on the 2-core CPU: `lab.tools.eagle_tune` replays tree sizes, then `lab bench` checked the
best few against the earlier default (16, 3) in one run (docs/benchmarks.md). On a GPU, where a verify row is
nearly free, larger trees (more tokens a round) pay; set total_tokens and depth there.
Deliberate differences: EOS nodes are not expanded; no repetition penalty (it would depend on each node's path);
the head only scores its draft vocabulary V_d (`lab.heads.eagle`).
The shipped head (`head`, used when `heads_path` is empty) is EAGLE-3 (Li et al. 2025: the draft reads a fusion of
a low, a middle and a high target layer and is trained with training-time test; `lab.heads.eagle3`, shipped as the
SafeAILab-layout folder `heads/<model>/eagle3/`) or EAGLE-1 (the final layer's feature, `heads/<model>/eagle.*`).
`heads_path` also takes published heads (SafeAILab EAGLE-1/2 and EAGLE-3, speculators EAGLE-3: lab.heads.published);
an EAGLE-3 head reads the fused target layers it names through `feature_layers`.
Not covered: batching, stochastic (sampled) draft trees.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lab.engine.models import LoadedModel
from lab.engine.sampling import SamplingConfig
from lab.heads import published_build
from lab.heads.common import find_heads
from lab.heads.eagle import KIND, EagleHead, build_head, serving_head
from lab.heads.eagle3 import Eagle3Head
from lab.heads.published import is_lab_stem
from lab.params import DecodeParams, InputError, param
from lab.registry import Strategy
from lab.speculative.proposers import cached_heads
from lab.speculative.proposers.eagle import EagleProposer, TreeShape
from lab.speculative.tree import TreeSettings, tree_loop
from lab.trace import Event

MODES = ("greedy", "sample")
SHIPPED_HEADS = ("eagle3", "eagle1")


@dataclass(frozen=True)
class EagleParams(DecodeParams):
    mode: str = param("greedy", choices=MODES, help="greedy: exact argmax path; sample: EAGLE-2's lossless rule.")
    total_tokens: int = param(4, low=1, high=128, help="Draft nodes kept after reranking by c(x) (verify size).")
    depth: int = param(2, low=1, high=16, help="Draft tree levels: head forwards per round (longest draft).")
    branch: int = param(8, low=1, high=16, help="EAGLE-2's top_k: children per expanded node and frontier width.")
    temperature: float = param(
        1.0, low=0.05, high=2.0, help="sample: p = softmax(z / T) of the target.", only_when=("mode", "sample")
    )
    top_p: float = param(1.0, low=0.05, high=1.0, help="sample: nucleus on p (1 = off).", only_when=("mode", "sample"))
    head: str = param(
        "eagle3", choices=SHIPPED_HEADS, help="Shipped head if heads_path is empty: EAGLE-3 (fused layers) or EAGLE-1."
    )
    heads_path: str = param(
        "", help="Lab head file/stem, or a published EAGLE / EAGLE-3 folder or Hub id (empty = the shipped `head`)."
    )

    @property
    def sampling(self) -> SamplingConfig:
        if self.mode == "greedy":
            return SamplingConfig(temperature=0.0)
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p)


def shipped_eagle3(loaded: LoadedModel) -> str:
    """The folder of the EAGLE-3 head shipped for this model; InputError naming the way out when there is none."""
    folder = find_heads("eagle3", loaded)
    if not (folder / "config.json").is_file():
        raise InputError(
            f"No EAGLE-3 head is shipped for {loaded.spec} (looked in {folder}); choose head = eagle1, give "
            f"heads_path, or train one with `python -m lab train-heads --kind eagle3 --model {loaded.spec}`."
        )
    return str(folder)


def cached_head(loaded: LoadedModel, path: str, head: str) -> EagleHead | Eagle3Head:
    """The trained head for this model (`path`: a lab file, or a published EAGLE / EAGLE-3 folder or Hub id:
    `lab.heads.published`; empty: the shipped `head`), loaded once per model, dtype and path."""
    if not path and head == "eagle3":
        path = shipped_eagle3(loaded)
    if path and not is_lab_stem(path):
        return serving_head(published_build.cached("eagle", loaded, path), loaded)  # cached per model: in place

    def build(tensors: dict, config: dict) -> EagleHead:
        return serving_head(build_head(loaded, tensors["vocab"], tensors), loaded)

    return cached_heads(KIND, loaded, path, build)


def proposer_for(loaded: LoadedModel, params: EagleParams) -> EagleProposer:
    shape = TreeShape(params.total_tokens, params.depth, params.branch)
    return EagleProposer(cached_head(loaded, params.heads_path, params.head), shape)


def run(loaded: LoadedModel, prompt_ids: list[int], params: EagleParams, generator: torch.Generator) -> Iterator[Event]:
    settings = TreeSettings(params.max_new_tokens, params.sampling, params.mode, method="eagle")
    return tree_loop(loaded, prompt_ids, proposer_for(loaded, params), generator, settings)


STRATEGY = Strategy(
    name="eagle",
    family="speculative",
    summary="A one-layer head drafts features; EAGLE-2 grows a dynamic tree by confidence, one forward verifies it.",
    paper="Li et al. 2024, EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty; "
    "Li et al. 2024, EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees",
    Params=EagleParams,
    run=run,
)
