"""Published draft heads: recognise a folder (or Hub id) in a reference layout, read it safely, check it.

`heads_path` of the EAGLE and Medusa strategies accepts, besides the lab's own `<kind>.safetensors` stems, a
folder or a Hugging Face Hub id (fetched with `huggingface_hub.snapshot_download`, only the config and weight
files) in one of these layouts, told apart by their files and config keys (`detect`):

| layout | files | recognised by |
|---|---|---|
| `eagle` (SafeAILab EAGLE-1/2) | config.json + pytorch_model.bin or model.safetensors | `fc`, `layers.0.*` |
| `eagle3` (SafeAILab EAGLE-3) | config.json + pytorch_model.bin or model.safetensors | `midlayer.*` |
| `speculators-eagle3` (vLLM's) | config.json + model.safetensors | `speculators_config` |
| `medusa` (FasterDecoding) | config.json + medusa_lm_head.safetensors or .pt | the file name |

Weights: safetensors are read first; a pickle (`.bin` / `.pt`) only through `torch.load(weights_only=True)`,
and refused with a clear message when that fails. Remote code is never run. Every config is checked against
the target (hidden size, vocabulary, layer count, fused layer ids) before a head is built, with a message
naming both sides (`InputError`, shown to the user as is). `lab.heads.published_build` turns the tensors into
the lab's heads. Not covered: sharded head checkpoints (`*.index.json`), Medusa-2's fine-tuned base weights.
"""

from __future__ import annotations

import json
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from lab.engine.models import LoadedModel
from lab.params import InputError

LAYOUTS = ("eagle", "eagle3", "speculators-eagle3", "medusa")
EAGLE_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
MEDUSA_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
HUB_FILES = ["config.json", *EAGLE_WEIGHTS, *MEDUSA_WEIGHTS]
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
EXPECTED = (
    "a published head folder: SafeAILab EAGLE-1/2 (config.json + pytorch_model.bin or model.safetensors with "
    "fc.* and layers.0.*), SafeAILab EAGLE-3 (the same files with fc.*, midlayer.*, norm, lm_head, d2t, t2d), "
    "the speculators format (config.json with speculators_config + model.safetensors) or FasterDecoding Medusa "
    "(config.json with medusa_num_heads + medusa_lm_head.safetensors or medusa_lm_head.pt)"
)


@dataclass(frozen=True)
class Published:
    """A recognised head folder: its layout, config.json, tensors (CPU, as stored) and the weight file."""

    layout: str
    folder: Path
    config: dict
    tensors: dict[str, torch.Tensor]
    weights: Path


def is_lab_stem(path: str) -> bool:
    """True for the lab's own `<stem>.safetensors` / `<stem>.json` heads (a file or a stem), not a folder."""
    p = Path(path)
    if p.is_dir():
        return False
    stem = p.with_suffix("") if p.suffix in (".safetensors", ".json") else p
    return stem.with_suffix(".safetensors").is_file() or stem.with_suffix(".json").is_file()


def resolve_folder(path: str) -> Path:
    """A local folder as is; otherwise a Hub id, downloaded (config and weight files only)."""
    folder = Path(path).expanduser()
    if folder.is_dir():
        return folder
    if not HUB_ID.match(path.strip()):
        raise InputError(f"heads_path {path!r} is neither a folder, a lab head file, nor a Hub id (owner/name).")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path.strip(), allow_patterns=HUB_FILES))
    except Exception as error:  # noqa: BLE001 - offline, unknown repo, gated: all become one clear message
        raise InputError(
            f"heads_path {path!r} is not a local folder, and downloading it from the Hugging Face Hub failed "
            f"({type(error).__name__}: {error}). Download it where there is a network and pass the folder."
        ) from None


def read_tensors(file: Path) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file or of a pickle read with `torch.load(weights_only=True)` (CPU)."""
    if file.suffix == ".safetensors":
        try:
            return load_file(str(file))
        except (SafetensorError, OSError, ValueError) as error:
            raise InputError(f"Cannot read {file}: not a complete safetensors file (truncated?): {error}") from None
    try:
        state = torch.load(str(file), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if "weights only load failed" not in str(error).lower():  # a damaged pickle, not a refused one
            raise InputError(f"Cannot read {file}: the pickle is incomplete or corrupt (truncated?): {error}") from None
        raise InputError(
            f"Refused {file}: torch.load(weights_only=True) rejects this pickle (it holds more than tensors, and "
            f"the lab never unpickles arbitrary objects). Convert it to safetensors. Detail: {error}"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as error:
        raise InputError(f"Cannot read {file}: the pickle is incomplete or corrupt (truncated?): {error}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise InputError(f"Refused {file}: expected a dict of tensors, got {type(state).__name__}.")
    return state


def _config(folder: Path) -> dict:
    file = folder / "config.json"
    if not file.is_file():
        raise InputError(f"No config.json in {folder}; expected {EXPECTED}.")
    try:
        config = json.loads(file.read_text())
    except (ValueError, OSError) as error:
        raise InputError(f"Cannot read {file}: {error}") from None
    if not isinstance(config, dict):
        raise InputError(f"{file} is not a JSON object.")
    return config


def _first(folder: Path, names: tuple[str, ...]) -> Path | None:
    return next((folder / n for n in names if (folder / n).is_file()), None)


def detect(folder: Path) -> Published:
    """Recognise the layout of `folder` by its files and config keys; InputError naming what was expected."""
    medusa = _first(folder, MEDUSA_WEIGHTS)
    if medusa is not None:
        return Published("medusa", folder, _config(folder), read_tensors(medusa), medusa)
    weights = _first(folder, EAGLE_WEIGHTS)
    if weights is None:
        found = sorted(p.name for p in folder.iterdir())[:12] if folder.is_dir() else []
        raise InputError(f"No head weights in {folder} (found {found}); expected {EXPECTED}.")
    config, tensors = _config(folder), read_tensors(weights)
    if "speculators_config" in config or "speculators_model_type" in config:
        kind = config.get("speculators_model_type")
        if kind != "eagle3":
            raise InputError(f"{folder} is a speculators {kind!r} checkpoint; the lab loads speculators 'eagle3'.")
        return Published("speculators-eagle3", folder, config, tensors, weights)
    if any(name.startswith("midlayer.") for name in tensors):
        return Published("eagle3", folder, config, tensors, weights)
    if "fc.weight" in tensors and any(name.startswith("layers.0.") for name in tensors):
        return Published("eagle", folder, config, tensors, weights)
    raise InputError(f"{weights} matches no known layout (tensors {sorted(tensors)[:8]}...); expected {EXPECTED}.")


def load_published(path: str) -> Published:
    """Resolve (folder or Hub id) and recognise a published head."""
    return detect(resolve_folder(path))


def require(published: Published, names: list[str]) -> None:
    """InputError naming the tensors a layout needs that the file lacks."""
    missing = [n for n in names if n not in published.tensors]
    if missing:
        raise InputError(f"{published.weights} ({published.layout}) lacks the tensors {missing}.")


def check_target(published: Published, loaded: LoadedModel, wants: dict[str, int | None]) -> None:
    """Compare the head's numbers with the target's (hidden size, vocabulary, ...); one message for all."""
    target = {
        "hidden size": int(loaded.config.hidden_size),
        "vocabulary": loaded.vocab_size,
        "layers": loaded.num_layers,
        "intermediate size": int(getattr(loaded.config, "intermediate_size", 0) or 0),
        "attention heads": int(loaded.config.num_attention_heads),
        "key/value heads": int(getattr(loaded.config, "num_key_value_heads", 0) or loaded.config.num_attention_heads),
    }
    wrong = [f"{k} {v} vs {target[k]}" for k, v in wants.items() if v is not None and int(v) != target[k]]
    if wrong:
        raise InputError(
            f"The {published.layout} head at {published.folder} does not fit {loaded.spec}: {'; '.join(wrong)} "
            f"(head vs target). Use the head published for this target model."
        )


def check_layer_ids(published: Published, loaded: LoadedModel, ids: list[int]) -> None:
    """Fused layer ids must be distinct inputs of target layers 0..L (L = the final hidden state)."""
    n = loaded.num_layers
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) > n:
        raise InputError(
            f"The EAGLE-3 head at {published.folder} fuses target layers {ids}, which {loaded.spec} "
            f"({n} layers) does not have as distinct layers 0..{n}."
        )
