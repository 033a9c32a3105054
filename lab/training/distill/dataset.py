"""Reading the self-distillation data (`lab.training.distill.generate`) back for head training.

`load_distill(folder)` (or a list of folders) concatenates every shard into one `DistillData`: row r is one
position p of one sequence with h_p (`hidden[r]`), the token that followed (`next_token[r]` = x_{p+1}) and the
model's top-k next-token distribution (`topk_ids[r]`, `topk_probs[r]`). `sequence[r]` and `position[r]` locate
the row; rows of one sequence are contiguous and in order, so row r + k is position p + k of the same sequence
iff `sequence[r + k] == sequence[r]` (see `future_rows`). `prompt[r]` is a stable key of the sequence's prompt
(CRC-32 of its token ids), so `held_out()` splits by prompt: every response to a held-out prompt is held out,
in every folder. Shards may also store features hidden_states[l] (`hidden.<l>`, for EAGLE-3); they are read only
when asked for (`layers`), into `features[l]` (fp16). Shards made before these existed read the same way.
Not covered: streaming data larger than memory.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from lab.params import InputError

HELD_OUT_EVERY = 20
BASE_KEYS = ("hidden", "topk_ids", "topk_probs")
Recompute = Callable[[Path], list[dict[str, torch.Tensor]]]  # an ids folder -> its shards with features


def feature_keys(layers: Sequence[int]) -> tuple[str, ...]:
    """The row tensors a trainer reads: the base keys and `hidden.<l>` for each extra layer."""
    return (*BASE_KEYS, *(f"hidden.{layer}" for layer in layers))


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
    prompt: torch.Tensor  # [N] int64, CRC-32 of the sequence's prompt token ids
    features: dict[int, torch.Tensor] = field(default_factory=dict)  # l -> [N, H] float16, hidden_states[l]

    @property
    def rows(self) -> int:
        return int(self.hidden.shape[0])

    def future_rows(self, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows r, rows r + offset) for every r whose position p + offset is in the same sequence."""
        r = torch.arange(self.rows - offset)
        keep = self.sequence[r] == self.sequence[r + offset]
        return r[keep], r[keep] + offset

    def held_out(self, every: int = HELD_OUT_EVERY) -> torch.Tensor:
        """[N] bool: rows whose prompt key is 0 mod `every` (a split by prompt, the same in every folder); when no
        key is, but there are several prompts, the prompt with the smallest key (small sets keep a held-out set)."""
        held = self.prompt % every == 0
        if not bool(held.any()) and self.rows and bool((self.prompt != self.prompt[0]).any()):
            held = self.prompt == self.prompt.min()
        return held

    def token_frequencies(self, vocab_size: int) -> torch.Tensor:
        """How often each token id appears as a response token (for frequency-ranked draft vocabularies)."""
        return torch.bincount(self.next_token, minlength=vocab_size)


def _rows_of_shard(shard: dict[str, torch.Tensor], first_sequence: int) -> dict[str, torch.Tensor]:
    tokens, offsets, prompt_lengths = shard["tokens"].long(), shard["seq_offsets"], shard["prompt_lengths"].long()
    next_tokens, inputs, sequences, positions, prompts = [], [], [], [], []
    for index in range(len(prompt_lengths)):
        sequence = tokens[offsets[index] : offsets[index + 1]]
        start = int(prompt_lengths[index]) - 1
        span = torch.arange(start, len(sequence) - 1)
        inputs.append(sequence[span])
        next_tokens.append(sequence[span + 1])
        sequences.append(torch.full_like(span, first_sequence + index))
        positions.append(span)
        key = zlib.crc32(sequence[: start + 1].to(torch.int32).numpy().tobytes())
        prompts.append(torch.full_like(span, key))
    return {
        "next_token": torch.cat(next_tokens),
        "token": torch.cat(inputs),
        "sequence": torch.cat(sequences),
        "position": torch.cat(positions),
        "prompt": torch.cat(prompts),
    }


def _read_shard(path: Path, layers: Sequence[int]) -> dict[str, torch.Tensor]:
    """The keys head training uses (and `hidden.<l>` for the requested layers) of one shard file."""
    wanted = ("tokens", "seq_offsets", "prompt_lengths", *feature_keys(layers))
    with safe_open(str(path), framework="pt") as shard:
        available = set(shard.keys())
        missing = [key for key in wanted if key not in available]
        if missing:
            raise InputError(f"{path} has no {', '.join(missing)}; make the data with `--layers` covering them.")
        return {key: shard.get_tensor(key) for key in wanted}


def load_distill(
    folders: str | Path | Sequence[str | Path], layers: Sequence[int] = (), recompute: Recompute | None = None
) -> DistillData:
    """All shards of one or more data folders, concatenated (sequence ids run on across folders); InputError
    when a folder holds no data, a shard lacks a requested layer, or the folders were made with different models
    or top-k. `layers`: the features hidden_states[l] to read as well (`features`). A folder of token ids only
    (`lab.training.distill.store`) gets its shards, features included, from `recompute(folder)` (e.g.
    `lab.training.distill.features.folder_features` with a model bound); without it, InputError.

    With several folders, `config` is {"model_shape": ..., "parts": [each folder's config]}."""
    paths = [Path(folders)] if isinstance(folders, str | Path) else [Path(f) for f in folders]
    if not paths:
        raise InputError("No self-distillation data folder given.")
    parts: dict[str, list[torch.Tensor]] = {}
    configs, sequences = [], 0
    for folder in paths:
        configs.append(_folder_config(folder))
        for shard in _folder_shards(folder, layers, recompute):
            for key, value in {**_rows_of_shard(shard, sequences), **shard}.items():
                if key not in ("tokens", "seq_offsets", "prompt_lengths"):
                    parts.setdefault(key, []).append(value)
            sequences += len(shard["prompt_lengths"])
    _check_compatible(configs, paths)
    joined = {key: torch.cat(values) for key, values in parts.items()}
    config = configs[0] if len(configs) == 1 else {"model_shape": configs[0]["model_shape"], "parts": configs}
    return DistillData(
        config=config,
        hidden=joined["hidden"],
        topk_ids=joined["topk_ids"].long(),
        topk_probs=joined["topk_probs"].float(),
        next_token=joined["next_token"],
        token=joined["token"],
        sequence=joined["sequence"],
        position=joined["position"],
        prompt=joined["prompt"],
        features={layer: joined[f"hidden.{layer}"] for layer in layers},
    )


def _folder_config(folder: Path) -> dict:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise InputError(f"No self-distillation data in {folder}; make it with `python -m lab distill --out {folder}`.")
    return json.loads(config_path.read_text())


def _folder_shards(folder: Path, layers: Sequence[int], recompute: Recompute | None) -> Iterator[dict]:
    """The shard dicts of one folder: read from its feature shards, or the ids shards with recomputed features."""
    from lab.training.distill.store import is_ids_folder

    if is_ids_folder(folder):
        if recompute is None:
            raise InputError(
                f"{folder} holds token ids only; its features are recomputed with the model (train-heads)."
            )
        yield from recompute(folder)
        return
    shards = sorted(folder.glob("shard_*.safetensors"))
    if not shards:
        raise InputError(f"No self-distillation data in {folder}; make it with `python -m lab distill --out {folder}`.")
    for path in shards:
        yield _read_shard(path, layers)


def _check_compatible(configs: list[dict], paths: list[Path]) -> None:
    first = configs[0]
    for config, path in zip(configs[1:], paths[1:], strict=True):
        if config["model_shape"] != first["model_shape"]:
            shapes = f"{config['model_shape']}, not {first['model_shape']}"
            raise InputError(f"{path} was made with a model of shape {shapes}.")
        top_k, first_top_k = config["settings"]["top_k"], first["settings"]["top_k"]
        if top_k != first_top_k:
            raise InputError(f"{path} stores top-{top_k}, {paths[0]} top-{first_top_k}.")
