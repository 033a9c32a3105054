"""Vanilla speculative decoding (Leviathan et al. 2023, Alg. 1; Chen et al. 2023) with three drafters.

Each round: 1. a proposer (`lab.speculative.proposers`) drafts up to gamma tokens x_1..x_gamma with distributions q_i
(prompt lookup: deterministic, q = None; self-draft: the target's first L layers + final norm + LM head; model:
any causal LM with the target's tokenizer), 2. the target scores [x_0, x_1..x_gamma] in one forward
(`lab.speculative.verify`), 3. `lab.speculative.acceptance` keeps x_i with probability min(1, p_i(x_i) /
q_i(x_i)), resamples the first rejected position from norm(max(0, p_i - q_i)), or draws a bonus token from
p_gamma when all are kept, 4. both KV caches roll back to the kept prefix, 5. the round's
`DraftRound`, its two `PipelineSpan`s (draft then verify, serial: the timeline SSD's is compared with) and one
`TokenEmitted` per token (source accepted / recovered / bonus) stream out, 6. gamma adapts.

Losslessness with processors: p_i = softmax(process(z_target)), the exact distribution `strategies.sample`
draws from at that position (repetition penalty over the history plus x_1..x_i), and q_i is the distribution
x_i was really drawn from (the draft logits through the same processors). Alg. 1 outputs tokens distributed
exactly as p for any q with x ~ q (Leviathan et al. 2023, Thm. 3.5), so the processors change what is sampled
(as in plain sampling), never the guarantee; using the same processors on q only raises acceptance. In greedy
mode (temperature 0) p and q are one-hot argmaxes (`target_distribution`): a draft token is kept iff it is the
target's argmax, so the output equals greedy decoding token for token (up to float ties: batched verify
logits could differ from one-token logits in the last bits; in bf16 `lab.engine.invariance` makes verify rows compute
exactly as one-token steps).
Sampling mode matches the target's distribution but not `sample`'s tokens for the same seed (other draws).

The loop is `lab.speculative.chain.chain_loop` with the serial schedule (adaptive gamma is documented there); the
first token comes from the prefill forward, as in greedy decoding.
TokenEmitted alternatives are the top 8 of softmax(processed target logits) at that position, for every
source (by losslessness it is the distribution each token is marginally drawn from).
Not covered: tree drafts (EAGLE, Medusa), SSD's asynchronous scheduling, batched sequences, drafters with
another tokenizer, typical acceptance (lossy).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lab.engine.models import LoadedModel
from lab.registry import Strategy
from lab.speculative.chain import chain_loop
from lab.speculative.params import ChainParams, chain_proposer, chain_settings
from lab.trace import Event


@dataclass(frozen=True)
class SpeculativeParams(ChainParams):
    """Vanilla speculative decoding's settings (all shared with SSD: `lab.speculative.params.ChainParams`)."""


def run(
    loaded: LoadedModel, prompt_ids: list[int], params: SpeculativeParams, generator: torch.Generator
) -> Iterator[Event]:
    return chain_loop(loaded, prompt_ids, chain_proposer(loaded, params), generator, chain_settings(params))


STRATEGY = Strategy(
    name="speculative",
    family="speculative",
    summary="Draft gamma tokens cheaply, verify them in one target forward, keep what p accepts (lossless).",
    paper="Leviathan et al. 2023, Fast Inference from Transformers via Speculative Decoding (Alg. 1); "
    "Chen et al. 2023, Accelerating LLM Decoding with Speculative Sampling",
    Params=SpeculativeParams,
    run=run,
)
