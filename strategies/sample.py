"""Plain autoregressive decoding: sampling with temperature, top-k, top-p, min-p and repetition penalty.

The one decode loop of the baseline family; `strategies.greedy` is this loop at temperature 0.
Each step: 1. process the last logits (HF order, `lab.sampling`), 2. pick a token (argmax or a seeded draw),
3. emit it with the top alternatives of the distribution it was drawn from, 4. stop at EOS or the budget,
5. run one decode step. Matches `model.generate` token for token in greedy mode (tested in fp32).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lab import runtime
from lab.models import LoadedModel
from lab.params import DecodeParams, param
from lab.sampling import SamplingConfig, choose_token, process_logits
from lab.text import IncrementalDetokenizer
from lab.trace import Event, RunFinished, TokenEmitted
from strategies.base import Strategy

TOP_ALTERNATIVES = 8


@dataclass(frozen=True)
class SampleParams(DecodeParams):
    temperature: float = param(0.8, low=0.05, high=2.0, help="p = softmax(z / T): below 1 sharpens, above 1 flattens.")
    top_k: int = param(50, low=0, high=1000, help="Keep only the k most likely tokens before sampling (0 = off).")
    top_p: float = param(0.95, low=0.05, high=1.0, help="Nucleus: smallest top set with total p >= top_p (1 = off).")
    min_p: float = param(0.0, low=0.0, high=0.5, help="Drop tokens with p < min_p * p_max (0 = off).")
    repetition_penalty: float = param(
        1.0, low=1.0, high=2.0, help="Seen tokens: z / r if z > 0 else z * r (CTRL; 1 = off)."
    )


def top_alternatives(processed_logits: torch.Tensor, loaded: LoadedModel) -> tuple[list[int], list[str], list[float]]:
    """The most likely tokens of softmax(processed_logits) with their texts and probabilities."""
    probs = processed_logits.softmax(dim=-1)  # [V]
    values, ids = torch.topk(probs, TOP_ALTERNATIVES)
    id_list = ids.tolist()
    return id_list, [loaded.token_text(i) for i in id_list], [round(v, 6) for v in values.tolist()]


def decode_loop(
    loaded: LoadedModel, prompt_ids: list[int], config: SamplingConfig, max_new_tokens: int, generator: torch.Generator
) -> Iterator[Event]:
    """Autoregressive decoding, one target forward per token, streaming a TokenEmitted per token."""
    start = time.perf_counter()
    state, out = runtime.prefill(loaded, prompt_ids)
    detokenizer = IncrementalDetokenizer(loaded.tokenizer)
    generated: list[int] = []
    stop_reason = "max_new_tokens"
    try:
        for step in range(max_new_tokens):
            processed = process_logits(out.logits[-1], config, prompt_ids + generated)  # 1. [V]
            token = choose_token(processed, config, generator)  # 2.
            generated.append(token)
            top_ids, top_tokens, top_probs = top_alternatives(processed, loaded)
            is_eos, is_last = token in loaded.eos_token_ids, step + 1 == max_new_tokens
            text = detokenizer.push(token) + (detokenizer.flush() if is_eos or is_last else "")
            yield TokenEmitted(step, token, text, "target", time.perf_counter() - start, top_ids, top_tokens, top_probs)
            if is_eos:  # 4.
                stop_reason = "eos"
                break
            if not is_last:
                out = runtime.decode_step(state, token)  # 5. [1, V]
        yield RunFinished(len(generated), stop_reason, time.perf_counter() - start, len(prompt_ids), state.forwards)
    finally:
        state.cache.reset()


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
