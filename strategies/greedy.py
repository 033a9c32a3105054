"""Greedy decoding: argmax of the (optionally repetition-penalized) next-token logits at every step.

The baseline every lossless method is checked against; the loop is `lab.engine.autoregressive.decode_loop` at T = 0.
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
class GreedyParams(DecodeParams):
    repetition_penalty: float = param(
        1.0, low=1.0, high=2.0, help="Seen tokens: z / r if z > 0 else z * r before the argmax (1 = off)."
    )


def run(
    loaded: LoadedModel, prompt_ids: list[int], params: GreedyParams, generator: torch.Generator
) -> Iterator[Event]:
    config = SamplingConfig(temperature=0.0, repetition_penalty=params.repetition_penalty)
    return decode_loop(loaded, prompt_ids, config, params.max_new_tokens, generator)


STRATEGY = Strategy(
    name="greedy",
    family="baseline",
    summary="Always take the most likely next token: x_t = argmax_x p(x | x_<t).",
    paper="(baseline)",
    Params=GreedyParams,
    run=run,
)
