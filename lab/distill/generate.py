"""Self-distillation data: the model's own responses to `lab.distill.prompts`, with its hidden states and top-k
next-token distributions, stored for training draft heads (Medusa, MTPC, EAGLE) with the base model frozen.

Per prompt (chat template on): one greedy response (unless `greedy` is off, for a second data set that adds only
samples) and `samples` sampled ones (temperature `temperature`, no top-k/top-p), up to `max_new_tokens`, cut
after the first EOS (kept: heads learn to stop). Then a teacher pass over prompt + response stores, for every
position p from the last prompt token to the one before the last token, the final hidden state h_p (after the
final norm, the LM head's input, fp16) and the top `top_k` of softmax(z_p) (the model's next-token distribution
at temperature 1), i.e. one row per response token.

Work is split into batches of `batch_size` prompts; each batch is one shard (`shard_00012.safetensors`) written
atomically, so an interrupted run resumes where it stopped. `config.json` records the settings and the model
shape; a rerun with other settings into the same folder is refused. Sampling is seeded per batch
(seed + batch index) through torch's global RNG, which HF `generate` draws from, so the data is reproducible on
the same machine and software (batched CPU/GPU kernels may differ in the last bits across machines).
Not covered: multi-turn data, datasets from the Hub (no network here), packing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from lab.distill.prompts import distill_prompts
from lab.heads.common import model_shape
from lab.models import LoadedModel
from lab.params import InputError

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class DistillSettings:
    """What the data depends on; stored in config.json and compared on resume."""

    model: str
    max_new_tokens: int = 256
    samples: int = 1
    temperature: float = 0.8
    top_k: int = 32
    batch_size: int = 8
    seed: int = 0
    limit: int | None = None
    greedy: bool = True  # off: sampled responses only (more data beside a folder that has the greedy ones)

    def check(self) -> None:
        if not 1 <= self.max_new_tokens <= 4096:
            raise InputError("--max-new-tokens must be between 1 and 4096.")
        if not 0 <= self.samples <= 16:
            raise InputError("--samples must be between 0 and 16.")
        if not self.greedy and self.samples == 0:
            raise InputError("--no-greedy needs --samples of at least 1.")
        if not 0.05 <= self.temperature <= 5:
            raise InputError("--temperature must be between 0.05 and 5.")
        if not 1 <= self.top_k <= 256 or not 1 <= self.batch_size <= 256:
            raise InputError("--top-k and --batch-size must be between 1 and 256.")
        if self.limit is not None and self.limit < 1:
            raise InputError("--limit must be at least 1.")


def _left_pad(sequences: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, width - len(sequence) :] = torch.tensor(sequence)
        mask[row, width - len(sequence) :] = 1
    return ids.to(device), mask.to(device)


def _cut_at_eos(tokens: list[int], eos_ids: tuple[int, ...]) -> list[int]:
    for index, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: index + 1]
    return tokens


@torch.inference_mode()
def generate_responses(
    loaded: LoadedModel, prompts: list[list[int]], settings: DistillSettings, sampled: bool
) -> list[list[int]]:
    """One response per prompt with HF generate (left-padded batch), cut after the first EOS."""
    pad_id = loaded.eos_token_ids[0]
    ids, mask = _left_pad(prompts, pad_id, loaded.device)
    sampling = {"do_sample": True, "temperature": settings.temperature, "top_k": 0, "top_p": 1.0}
    out = loaded.model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=settings.max_new_tokens,
        pad_token_id=pad_id,
        **(sampling if sampled else {"do_sample": False}),
    )
    new = out[:, ids.shape[1] :].tolist()  # [B, T_new]
    return [_cut_at_eos(row, loaded.eos_token_ids) for row in new]


@torch.inference_mode()
def teacher_pass(loaded: LoadedModel, prompt: list[int], response: list[int], top_k: int) -> dict[str, torch.Tensor]:
    """h_p and top-k softmax(z_p) for p = len(prompt) - 1 .. len(prompt) + len(response) - 2."""
    tokens = torch.tensor([prompt + response], device=loaded.device)  # [1, T]
    out = loaded.model(input_ids=tokens, output_hidden_states=True)
    start, end = len(prompt) - 1, len(prompt) + len(response) - 1
    hidden = out.hidden_states[-1][0, start:end]  # [M, H], after the final norm
    probs = torch.softmax(out.logits[0, start:end].float(), dim=-1)  # [M, V]
    top = probs.topk(top_k, dim=-1)
    return {
        "hidden": hidden.to(torch.float16).cpu(),
        "topk_ids": top.indices.to(torch.int32).cpu(),
        "topk_probs": top.values.to(torch.float16).cpu(),
    }


def _shard_tensors(records: list[tuple[list[int], list[int], dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Concatenate one batch's sequences: tokens with offsets, prompt lengths, per-row tensors."""
    tokens = [torch.tensor(prompt + response, dtype=torch.int32) for prompt, response, _ in records]
    offsets = torch.tensor([0] + [len(t) for t in tokens], dtype=torch.int64).cumsum(0)
    return {
        "tokens": torch.cat(tokens),
        "seq_offsets": offsets,
        "prompt_lengths": torch.tensor([len(p) for p, _, _ in records], dtype=torch.int32),
        "hidden": torch.cat([r["hidden"] for _, _, r in records]),
        "topk_ids": torch.cat([r["topk_ids"] for _, _, r in records]),
        "topk_probs": torch.cat([r["topk_probs"] for _, _, r in records]),
    }


def _check_config(out_dir: Path, config: dict) -> None:
    path = out_dir / "config.json"
    if path.exists():
        existing = json.loads(path.read_text())
        existing.get("settings", {}).setdefault("greedy", True)  # folders made before the setting existed
        if existing != config:
            raise InputError(f"{out_dir} holds data made with other settings ({existing}); choose another --out.")
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config, indent=2))


def run_distill(loaded: LoadedModel, settings: DistillSettings, out_dir: Path, progress: Progress) -> Path:
    """Generate (or resume) the data set into `out_dir`; returns the folder."""
    settings.check()
    prompts = [text for _, text in distill_prompts()][: settings.limit]
    config = {"settings": asdict(settings), "model_shape": model_shape(loaded), "prompts": len(prompts)}
    _check_config(out_dir, config)
    batches = [prompts[i : i + settings.batch_size] for i in range(0, len(prompts), settings.batch_size)]
    for index, batch in enumerate(batches):
        shard = out_dir / f"shard_{index:05d}.safetensors"
        if shard.exists():
            progress(index + 1, len(batches), f"{shard.name} already done")
            continue
        torch.manual_seed(settings.seed + index)
        encoded = [loaded.encode(text, chat=True) for text in batch]
        records = []
        for variant in range(0 if settings.greedy else 1, 1 + settings.samples):
            responses = generate_responses(loaded, encoded, settings, sampled=variant > 0)
            for prompt, response in zip(encoded, responses, strict=True):
                if response:
                    records.append((prompt, response, teacher_pass(loaded, prompt, response, settings.top_k)))
        partial = shard.with_suffix(".partial")
        save_file(_shard_tensors(records), str(partial))
        os.replace(partial, shard)
        progress(index + 1, len(batches), f"{shard.name}: {sum(len(r) for _, r, _ in records)} response tokens")
    return out_dir
