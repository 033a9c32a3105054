"""Saving and loading draft heads, with the checks that keep a head and its base model together.

A head set is two files side by side: `<kind>.safetensors` (fp16 tensors) and `<kind>.json` (its config:
`kind`, `model_shape` = hidden size, vocabulary size and layer count of the base model, plus whatever the
kind needs, e.g. K heads or the draft vocabulary size). Heads shipped with the lab live in
`heads/<model slug>/` at the repository root; `find_heads(kind, loaded)` looks there unless given a path.
Loading refuses a head whose `model_shape` differs from the model's (InputError, with the command that trains
one). `draft_vocabulary` ranks token ids by frequency in the data (FR-Spec / EAGLE-3's reduced draft
vocabulary); verification always scores the full vocabulary, so outputs stay exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lab.engine.models import LoadedModel
from lab.params import InputError

HEADS_DIR = Path(__file__).resolve().parents[2] / "heads"


def model_slug(spec: str) -> str:
    """Folder name for a model spec: its last path component, filesystem-safe ("SmolLM2-135M-Instruct")."""
    name = spec.rstrip("/").split("/")[-1] or "model"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def model_shape(loaded: LoadedModel) -> dict[str, int]:
    """The numbers a head must match: hidden size, vocabulary size, layer count."""
    return {
        "hidden_size": int(loaded.config.hidden_size),
        "vocab_size": loaded.vocab_size,
        "num_layers": loaded.num_layers,
    }


def save_heads(stem: Path, tensors: dict[str, torch.Tensor], config: dict) -> tuple[Path, Path]:
    """Write `stem.safetensors` (floating tensors as fp16) and `stem.json`; returns both paths."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stored = {
        name: (t.detach().to(torch.float16) if t.is_floating_point() else t.detach()).contiguous().cpu()
        for name, t in tensors.items()
    }
    weights, meta = stem.with_suffix(".safetensors"), stem.with_suffix(".json")
    save_file(stored, str(weights))
    meta.write_text(json.dumps(config, indent=2, sort_keys=True))
    return weights, meta


def find_heads(kind: str, loaded: LoadedModel, path: str | None = None) -> Path:
    """The stem of the head set to load: `path` (file or stem) if given, else the shipped one for this model."""
    if path:
        stem = Path(path)
        return stem.with_suffix("") if stem.suffix in (".safetensors", ".json") else stem
    return HEADS_DIR / model_slug(loaded.spec) / kind


def load_heads(kind: str, loaded: LoadedModel, path: str | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors (float32, on the model's device) and config of a head set; InputError if missing or mismatched."""
    stem = find_heads(kind, loaded, path)
    weights, meta = stem.with_suffix(".safetensors"), stem.with_suffix(".json")
    train = f"python -m lab train-heads --kind {kind} --model {loaded.spec}"
    if not weights.is_file() or not meta.is_file():
        raise InputError(f"No {kind} heads for {loaded.spec} at {stem}.*; train them with `{train}`.")
    try:
        config = json.loads(meta.read_text())
        tensors = load_file(str(weights))
    except (ValueError, OSError) as error:
        raise InputError(f"Cannot read the {kind} heads at {stem}: {error}") from None
    if config.get("kind") != kind:
        raise InputError(f"{meta} holds {config.get('kind')!r} heads, not {kind!r}.")
    if config.get("model_shape") != model_shape(loaded):
        raise InputError(
            f"The {kind} heads at {stem} were trained for a model of shape {config.get('model_shape')}, "
            f"but {loaded.spec} has {model_shape(loaded)}; train matching heads with `{train}`."
        )
    device = loaded.device
    return {n: (t.float() if t.is_floating_point() else t).to(device) for n, t in tensors.items()}, config


def draft_vocabulary(frequencies: torch.Tensor, size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The `size` most frequent token ids (ties by id), plus `always` (e.g. EOS), sorted ascending. [size']"""
    if size >= frequencies.numel():
        return torch.arange(frequencies.numel())
    order = torch.argsort(-frequencies.long(), stable=True)  # most frequent first, ties by id
    chosen = set(order[:size].tolist()) | {i for i in always if 0 <= i < frequencies.numel()}
    return torch.tensor(sorted(chosen), dtype=torch.long)
