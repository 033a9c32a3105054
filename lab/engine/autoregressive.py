"""Plain autoregressive decoding, the one loop of the baseline family (`strategies.sample`, and `strategies.greedy`
at temperature 0; CFG reuses `top_alternatives`).

Each step: 1. process the last logits (HF order, `lab.engine.sampling`), 2. pick a token (argmax or a seeded draw),
3. emit it with the top alternatives of the distribution it was drawn from, 4. stop at EOS or the budget,
5. run one decode step. Matches `model.generate` token for token in greedy mode (tested in fp32).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from lab.engine import runtime
from lab.engine.models import LoadedModel
from lab.engine.sampling import SamplingConfig, choose_token, process_logits
from lab.engine.text import IncrementalDetokenizer
from lab.trace import Event, RunFinished, TokenEmitted

TOP_ALTERNATIVES = 8


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
