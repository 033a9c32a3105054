"""Reading the self-distillation data (`lab.distill.generate`) back for head training.

`load_distill(folder)` concatenates every shard into one `DistillData`: row r is one position p of one sequence
with h_p (`hidden[r]`), the token that followed (`next_token[r]` = x_{p+1}) and the model's top-k next-token
distribution (`topk_ids[r]`, `topk_probs[r]`). `sequence[r]` and `position[r]` locate the row; rows of one
sequence are contiguous and in order, so row r + k is position p + k of the same sequence iff
`sequence[r + k] == sequence[r]` (see `future_rows`). Not covered: streaming data larger than memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from lab.params import InputError


@dataclass(frozen=True)
class DistillData:
    config: dict
    hidden: torch.Tensor  # [N, H] float16, h_p after the final norm
    topk_ids: torch.Tensor  # [N, k] int64
    topk_probs: torch.Tensor  # [N, k] float32
    next_token: torch.Tensor  # [N] int64, x_{p+1}
    token: torch.Tensor  # [N] int64, x_p (the input token at position p)
    sequence: torch.Tensor  # [N] int64
    position: torch.Tensor  # [N] int64

    @property
    def rows(self) -> int:
        return int(self.hidden.shape[0])

    def future_rows(self, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows r, rows r + offset) for every r whose position p + offset is in the same sequence."""
        r = torch.arange(self.rows - offset)
        keep = self.sequence[r] == self.sequence[r + offset]
        return r[keep], r[keep] + offset

    def token_frequencies(self, vocab_size: int) -> torch.Tensor:
        """How often each token id appears as a response token (for frequency-ranked draft vocabularies)."""
        return torch.bincount(self.next_token, minlength=vocab_size)


def _rows_of_shard(shard: dict[str, torch.Tensor], first_sequence: int) -> dict[str, torch.Tensor]:
    tokens, offsets, prompt_lengths = shard["tokens"].long(), shard["seq_offsets"], shard["prompt_lengths"].long()
    next_tokens, inputs, sequences, positions = [], [], [], []
    for index in range(len(prompt_lengths)):
        sequence = tokens[offsets[index] : offsets[index + 1]]
        start = int(prompt_lengths[index]) - 1
        span = torch.arange(start, len(sequence) - 1)
        inputs.append(sequence[span])
        next_tokens.append(sequence[span + 1])
        sequences.append(torch.full_like(span, first_sequence + index))
        positions.append(span)
    return {
        "next_token": torch.cat(next_tokens),
        "token": torch.cat(inputs),
        "sequence": torch.cat(sequences),
        "position": torch.cat(positions),
    }


def load_distill(folder: str | Path) -> DistillData:
    """All shards of a data folder, concatenated; InputError when the folder holds no data."""
    folder = Path(folder)
    config_path = folder / "config.json"
    shards = sorted(folder.glob("shard_*.safetensors"))
    if not config_path.is_file() or not shards:
        raise InputError(f"No self-distillation data in {folder}; make it with `python -m lab distill --out {folder}`.")
    parts: dict[str, list[torch.Tensor]] = {}
    sequences = 0
    for path in shards:
        shard = load_file(str(path))
        for key, value in {**_rows_of_shard(shard, sequences), **shard}.items():
            if key not in ("tokens", "seq_offsets", "prompt_lengths"):
                parts.setdefault(key, []).append(value)
        sequences += len(shard["prompt_lengths"])
    joined = {key: torch.cat(values) for key, values in parts.items()}
    return DistillData(
        config=json.loads(config_path.read_text()),
        hidden=joined["hidden"],
        topk_ids=joined["topk_ids"].long(),
        topk_probs=joined["topk_probs"].float(),
        next_token=joined["next_token"],
        token=joined["token"],
        sequence=joined["sequence"],
        position=joined["position"],
    )
