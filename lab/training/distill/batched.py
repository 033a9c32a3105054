"""Batched decoding with a KV cache that captures, in the generation pass itself, what head training needs.

`decode_batch` runs B prompts at once: left padding (attention mask + position ids from the mask), one prefill,
then one forward per new token for the rows still running. A row stops after its first EOS (kept) or at
`max_new_tokens`; finished rows leave the batch (`DynamicCache.batch_select_indices`), so a long response
does not make short ones pay. Tokens are greedy (argmax z_p) or sampled from softmax(z_p / T) with an explicit
`torch.Generator`.

With `capture` set, every forward also stores, for the position p it was fed (the last prompt token, then each
response token but the last, i.e. one row per response token, as `lab.training.distill.generate` documents):
    h_p = hidden_states[L] (after the final norm), the features hidden_states[l] for l in `capture.layers`
    (the input of layer l; EAGLE-3 uses l = 2, L // 2, L - 3), all fp16, and the top `capture.top_k` of
    softmax(z_p) (the model's next-token distribution at temperature 1).
Without `capture` (Magpie prompt writing) only the tokens come back.
Not covered: continuous batching (refilling freed slots), top-k / top-p sampling, multi-turn prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from lab.engine import runtime
from lab.engine.models import LoadedModel


@dataclass(frozen=True)
class Capture:
    top_k: int = 32
    layers: tuple[int, ...] = ()  # extra hidden_states[l] to store besides hidden_states[L]


@dataclass(frozen=True)
class Decoded:
    """One row of the batch: its response tokens and, with capture, per-response-token tensors (fp16 / int32)."""

    response: list[int]
    tensors: dict[str, torch.Tensor]


def left_pad(sequences: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, T], mask [B, T]) with every sequence right-aligned."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, width - len(sequence) :] = torch.tensor(sequence, dtype=torch.long)
        mask[row, width - len(sequence) :] = 1
    return ids.to(device), mask.to(device)


def _choose(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """x_{p+1}: argmax z_p when temperature is 0, else a draw from softmax(z_p / T). [B]"""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [B, V]
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _captured(hidden: tuple[torch.Tensor, ...], logits: torch.Tensor, capture: Capture) -> dict[str, torch.Tensor]:
    """The rows of one forward at its last position: h_p, extra features, top-k of softmax(z_p)."""
    top = torch.softmax(logits.float(), dim=-1).topk(capture.top_k, dim=-1)
    rows = {
        "hidden": hidden[-1][:, -1].to(torch.float16).cpu(),  # [b, H]
        "topk_ids": top.indices.to(torch.int32).cpu(),  # [b, k]
        "topk_probs": top.values.to(torch.float16).cpu(),
    }
    for layer in capture.layers:
        rows[f"hidden.{layer}"] = hidden[layer][:, -1].to(torch.float16).cpu()
    return rows


@torch.inference_mode()
def decode_batch(
    loaded: LoadedModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    capture: Capture | None = None,
    stop_ids: tuple[int, ...] | None = None,
) -> list[Decoded]:
    """Generate one response per prompt (module docstring); rows in the order of `prompts`."""
    stop = torch.tensor(stop_ids if stop_ids is not None else loaded.eos_token_ids, device=loaded.device)
    ids, mask = left_pad(prompts, int(stop[0]), loaded.device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache(config=loaded.config)
    active = torch.arange(len(prompts))  # original row of each batch row
    responses: list[list[int]] = [[] for _ in prompts]
    steps: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []
    hidden = capture is not None
    for step in range(max_new_tokens):
        # 1. one forward over the new tokens of the running rows (the whole prompts at step 0)
        out, states = runtime.model_forward(
            loaded, ids, cache, attention_mask=mask, position_ids=positions, logits_to_keep=1, hidden_states=hidden
        )
        logits = out[:, -1]  # [b, V]
        # 2. store this position's rows, choose x_{p+1}
        if capture is not None:
            steps.append((active, _captured(states, logits, capture)))
        chosen = _choose(logits, temperature, generator)  # [b]
        for row, token in zip(active.tolist(), chosen.tolist(), strict=True):
            responses[row].append(token)
        # 3. drop finished rows (EOS or length), feed the chosen tokens of the others
        running = ~torch.isin(chosen, stop)
        if step + 1 == max_new_tokens or not bool(running.any()):
            break
        if not bool(running.all()):
            keep = running.nonzero()[:, 0]
            cache.batch_select_indices(keep)
            active, chosen, mask, positions = active[keep.cpu()], chosen[keep], mask[keep], positions[keep]
        ids = chosen[:, None]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
    return [Decoded(response, {}) for response in responses] if capture is None else _gather(responses, steps)


def _gather(responses: list[list[int]], steps: list[tuple[torch.Tensor, dict[str, torch.Tensor]]]) -> list[Decoded]:
    """Regroup the per-step rows by sequence (step order within a sequence)."""
    rows = torch.cat([active for active, _ in steps])  # [M] original row of each captured row
    order = torch.argsort(rows, stable=True)  # steps are already in order: stable keeps them so
    joined = {name: torch.cat([part[name] for _, part in steps])[order] for name in steps[0][1]}
    counts = torch.bincount(rows, minlength=len(responses)).tolist()
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    decoded = []
    for index, response in enumerate(responses):
        assert counts[index] == len(response), "one captured row per response token"
        decoded.append(Decoded(response, {n: t[starts[index] : starts[index + 1]] for n, t in joined.items()}))
    return decoded
