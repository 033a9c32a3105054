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
Without `capture` (Magpie prompt writing, the token-id store) only the tokens come back, and where the model's
forwards take the native path (`lab.engine.forward_path`: the C++ op of the decoder layers) the rows are not padded:
each prompt is prefilled alone (`lab.engine.runtime.prefill`, identical prompts once) and every step feeds one token
to each running sequence in one forward (`lab.engine.runtime.decode_steps`: the products over all rows at once,
each sequence attending to its own cache), so a greedy row is exactly the lab's own greedy decoding of its prompt
at that precision. `path="padded"` forces the left-padded batch (the comparison of `scripts/distill_speed.py`).
Not covered: continuous batching (refilling freed slots), top-k / top-p sampling, multi-turn prompts.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from lab.engine import forward_path, runtime
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


def _choose(logits: torch.Tensor, temperature: float | list[float], generator: torch.Generator | None) -> torch.Tensor:
    """x_{p+1} per row: argmax z_p where the row's temperature is 0, else a draw from softmax(z_p / T) (the sampled
    rows in one draw, in row order). [B]"""
    if not isinstance(temperature, list):
        if temperature <= 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / temperature, dim=-1)  # [B, V]
        return torch.multinomial(probs, 1, generator=generator)[:, 0]
    chosen = logits.argmax(-1)
    hot = [row for row, t in enumerate(temperature) if t > 0]
    if hot:
        scale = torch.tensor([temperature[row] for row in hot], device=logits.device)[:, None]
        probs = torch.softmax(logits[hot].float() / scale, dim=-1)
        chosen[hot] = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return chosen


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
    temperature: float | list[float] = 0.0,
    generator: torch.Generator | None = None,
    capture: Capture | None = None,
    stop_ids: tuple[int, ...] | None = None,
    path: str = "auto",
    width: int | None = None,
) -> list[Decoded]:
    """Generate one response per prompt (module docstring); rows in the order of `prompts`. `temperature`: one for
    all, or one per prompt (0: greedy). `path`: "auto" (unpadded batched steps where the native path runs and
    nothing is captured, else the padded batch) or "padded". `width`: at most this many sequences decode together
    (None: all); the unpadded steps start the next prompt as soon as a sequence ends (continuous batching), the
    padded batch takes the prompts `width` at a time."""
    if path not in ("auto", "padded"):
        raise ValueError(f"path must be auto or padded, not {path!r}")
    if isinstance(temperature, list) and len(temperature) != len(prompts):
        raise ValueError(f"{len(temperature)} temperatures for {len(prompts)} prompts")
    width = len(prompts) if width is None else width
    if width < 1:
        raise ValueError(f"width must be at least 1, not {width}")
    stop_ids = tuple(stop_ids if stop_ids is not None else loaded.eos_token_ids)
    if path == "auto" and capture is None and forward_path.current(loaded).native:
        sequences = _Sequences(loaded, prompts, temperature, generator, set(stop_ids))
        return [Decoded(response, {}) for response in sequences.run(max_new_tokens, width)]
    if width < len(prompts):
        decoded = []
        for first in range(0, len(prompts), width):
            part = temperature[first : first + width] if isinstance(temperature, list) else temperature
            chunk = prompts[first : first + width]
            decoded += decode_batch(loaded, chunk, max_new_tokens, part, generator, capture, stop_ids, "padded")
        return decoded
    if isinstance(temperature, list) and len(set(temperature)) == 1:
        temperature = temperature[0]
    stop = torch.tensor(stop_ids, device=loaded.device)
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
        rows_temperature = (
            [temperature[row] for row in active.tolist()] if isinstance(temperature, list) else temperature
        )
        chosen = _choose(logits, rows_temperature, generator)  # [b]
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


class _Sequences:
    """`decode_batch` without padding (module docstring): each prompt prefilled alone when it starts (a repeated
    prompt copies the first one's cache), then one forward per step over the running sequences; a sequence ends
    after its first stop token (kept) or at the length limit, and the next waiting prompt takes its place."""

    def __init__(self, loaded, prompts, temperature, generator, stop: set[int]) -> None:
        self.loaded, self.prompts, self.generator, self.stop = loaded, prompts, generator, stop
        self.temperatures = temperature if isinstance(temperature, list) else [temperature] * len(prompts)
        self.prefilled: dict[tuple[int, ...], tuple[runtime.DecodeState, torch.Tensor]] = {}
        self.repeated = {tuple(p) for p in prompts if prompts.count(p) > 1}

    def _start(self, row: int) -> tuple[runtime.DecodeState, torch.Tensor]:
        key = tuple(self.prompts[row])
        if key in self.prefilled:  # the same prompt again (Magpie's chunks): its own copy of the cache
            state, logits = self.prefilled[key]
            return runtime.DecodeState(self.loaded, copy.deepcopy(state.cache), 1, list(state.tokens)), logits
        state, out = runtime.prefill(self.loaded, self.prompts[row])
        if key in self.repeated:
            self.prefilled[key] = (
                runtime.DecodeState(self.loaded, copy.deepcopy(state.cache), 1, list(state.tokens)),
                out.logits[-1],
            )
        return state, out.logits[-1]

    def run(self, max_new_tokens: int, width: int) -> list[list[int]]:
        waiting = list(range(len(self.prompts)))[::-1]  # popped from the end: prompt order
        responses: list[list[int]] = [[] for _ in self.prompts]
        states: dict[int, runtime.DecodeState] = {}
        logits: dict[int, torch.Tensor] = {}
        while waiting or states:
            while waiting and len(states) < width:
                row = waiting.pop()
                states[row], logits[row] = self._start(row)
            rows = list(states)
            temperatures = [self.temperatures[row] for row in rows]
            chosen = _choose(torch.stack([logits.pop(row) for row in rows]), temperatures, self.generator).tolist()
            fed = []
            for row, token in zip(rows, chosen, strict=True):
                responses[row].append(token)
                if token in self.stop or len(responses[row]) == max_new_tokens:
                    del states[row]  # ended: its cache is freed, a waiting prompt takes the place
                else:
                    fed.append((row, token))
            if fed:
                out = runtime.decode_steps([states[row] for row, _ in fed], [token for _, token in fed])
                logits.update((row, out[i]) for i, (row, _) in enumerate(fed))
        return responses


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
