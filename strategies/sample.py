"""Plain autoregressive decoding: sampling with temperature, top-k, top-p, min-p and repetition penalty.

The loop is `lab.engine.autoregressive.decode_loop` (`strategies.greedy` runs it at temperature 0).
Each step: 1. process the last logits (HF order, `lab.engine.sampling`), 2. pick a token (argmax or a seeded draw),
3. emit it with the top alternatives of the distribution it was drawn from, 4. stop at EOS or the budget,
5. run one decode step. Matches `model.generate` token for token in greedy mode (tested in fp32).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lab.engine.autoregressive import decode_loop
from lab.engine.models import LoadedModel
from lab.engine.sampling import SamplingConfig
from lab.params import DecodeParams, param
from lab.registry import Strategy
from lab.trace import Event


@dataclass(frozen=True)
class SampleParams(DecodeParams):
    temperature: float = param(0.8, low=0.05, high=2.0, help="p = softmax(z / T): below 1 sharpens, above 1 flattens.")
    top_k: int = param(50, low=0, high=1000, help="Keep only the k most likely tokens before sampling (0 = off).")
    top_p: float = param(0.95, low=0.05, high=1.0, help="Nucleus: smallest top set with total p >= top_p (1 = off).")
    min_p: float = param(0.0, low=0.0, high=0.5, help="Drop tokens with p < min_p * p_max (0 = off).")
    repetition_penalty: float = param(
        1.0, low=1.0, high=2.0, help="Seen tokens: z / r if z > 0 else z * r (CTRL; 1 = off)."
    )


def run(
    loaded: LoadedModel, prompt_ids: list[int], params: SampleParams, generator: torch.Generator
) -> Iterator[Event]:
    config = SamplingConfig(params.temperature, params.top_k, params.top_p, params.min_p, params.repetition_penalty)
    return decode_loop(loaded, prompt_ids, config, params.max_new_tokens, generator)


STRATEGY = Strategy(
    name="sample",
    family="baseline",
    summary="Ancestral sampling from the processed next-token distribution.",
    paper="Holtzman et al. 2020 (nucleus); Nguyen et al. 2024 (min-p); Keskar et al. 2019 (repetition penalty)",
    Params=SampleParams,
    run=run,
)
