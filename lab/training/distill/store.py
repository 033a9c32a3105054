"""Self-distillation data kept in the repository: the responses as token ids only, one compressed shard at a time.

`python -m lab distill --store FOLDER` (e.g. heads/data/smollm2-135m/magpie-s0, a tracked folder) writes per shard:
    shard_00012.npz    np.savez_compressed of `tokens` (uint16, every sequence = prompt ids + response ids, one after
                       the other), `seq_offsets` (uint32, len + 1) and `prompt_lengths` (uint16): the layout of the
                       feature shards of `lab.training.distill.generate`, without any feature
    shard_00012.json   its manifest: how it was made (model, model shape, precision, dtype, sampling, seed, command,
                       software), what it holds (sequences, prompt and response tokens, `prompt_range`: the
                       prompts' index range in the plan's hand-written list or the Magpie chunk, and their texts)
                       and the SHA-256 of the .npz; written last, so a shard counts as made when it exists
The folder's `config.json` holds the settings the whole plan shares (`DistillSettings`, precision, dtype, model
shape); a run with other settings into the folder is refused. The plan is the settings' shard list (the hand-written
prompts that pass the overlap check, in batches of `batch_size`, or `magpie_chunks` Magpie chunks); a run makes the
shards of the plan whose manifest is missing, at most `max_shards` of them, so sessions can each add shards and
commit them. Shard i samples with seed + i (as the feature shards), so which session makes it does not change it
(on the same software).
Magpie: chunk c's raw candidates and kept prompts (`candidates/`, `prompts/`) are committed beside the shards; the
filter of chunk c needs every prompt kept before it, read from `prompts/` where present (else filtered again from
the candidates, written first when missing). Features are not stored: `lab.training.distill.features` recomputes
them from the ids. Not covered: vocabularies over 65,535 ids (uint16), merging folders.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from lab.engine.models import LoadedModel
from lab.heads.common import model_shape
from lab.params import InputError
from lab.training.distill.generate import DistillSettings, Progress, Record, _check_config, respond
from lab.training.distill.magpie import cached_candidates
from lab.training.distill.prompt_filter import PromptPool, near_benchmark
from lab.training.distill.prompts import distill_prompts

IDS_FORMAT = "token-ids/npz-uint16/v1"
MAX_ID = np.iinfo(np.uint16).max


def shard_name(index: int) -> str:
    return f"shard_{index:05d}"


def is_ids_folder(folder: Path) -> bool:
    """True when `folder` holds token-id shards (its config.json names IDS_FORMAT)."""
    config = Path(folder) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("format") == IDS_FORMAT


def made_shards(folder: Path) -> list[int]:
    """Indices of the shards whose manifest exists (made and complete)."""
    return sorted(int(p.stem.split("_")[1]) for p in Path(folder).glob("shard_*.json"))


def pack_ids(records: list[tuple[list[int], list[int]]]) -> bytes:
    """The .npz bytes of (prompt ids, response ids) pairs (module docstring); InputError for an id over 65,535."""
    tokens = [prompt + response for prompt, response in records]
    flat = [token for sequence in tokens for token in sequence]
    if flat and (min(flat) < 0 or max(flat) > MAX_ID):
        raise InputError(f"token ids must be 0..{MAX_ID} to be stored as uint16; this vocabulary is larger.")
    buffer = io.BytesIO()
    np.savez_compressed(
        buffer,
        tokens=np.asarray(flat, dtype=np.uint16),
        seq_offsets=np.cumsum([0] + [len(t) for t in tokens]).astype(np.uint32),
        prompt_lengths=np.asarray([len(p) for p, _ in records], dtype=np.uint16),
    )
    return buffer.getvalue()


def read_ids(path: Path) -> dict[str, torch.Tensor]:
    """One .npz shard as the tensors `lab.training.distill.dataset` reads (tokens int32, offsets int64)."""
    with np.load(path) as arrays:
        return {
            "tokens": torch.from_numpy(arrays["tokens"].astype(np.int32)),
            "seq_offsets": torch.from_numpy(arrays["seq_offsets"].astype(np.int64)),
            "prompt_lengths": torch.from_numpy(arrays["prompt_lengths"].astype(np.int32)),
        }


def ids_sha256(shard: dict[str, torch.Tensor]) -> str:
    """A hash of a shard's token ids and sequence boundaries (what its features are a function of)."""
    digest = hashlib.sha256()
    for key in ("tokens", "seq_offsets", "prompt_lengths"):
        digest.update(shard[key].to(torch.int64).numpy().tobytes())
    return digest.hexdigest()


def _write_atomically(path: Path, data: bytes) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def _software() -> dict:
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


def _command() -> str:
    """The command line of this process (`python -m lab ...` when run as the lab's CLI)."""
    if sys.argv and sys.argv[0].endswith("__main__.py"):
        return "python -m lab " + shlex.join(sys.argv[1:])
    return shlex.join(sys.argv)


def _manifest(loaded: LoadedModel, settings: DistillSettings, index: int, prompts: dict, records, seconds: float):
    response = sum(len(r) for _, r in records)
    return {
        "format": IDS_FORMAT,
        "shard": index,
        "model": loaded.spec,
        "model_shape": model_shape(loaded),
        "precision": loaded.precision,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "device": str(loaded.device),
        "sampling": {
            "greedy": settings.greedy,
            "samples": settings.samples,
            "temperature": settings.temperature,
            "seed": settings.seed + index,
            "max_new_tokens": settings.max_new_tokens,
            "chat_template": True,
        },
        "command": _command(),
        "software": _software(),
        "sequences": len(records),
        "prompt_tokens": sum(len(p) for p, _ in records),
        "response_tokens": response,
        "seconds": round(seconds, 1),
        "tokens_per_s": round(response / seconds, 1) if seconds > 0 else None,
        **prompts,
    }


def handwritten_prompts(bench: list[str]) -> list[str]:
    """The hand-written prompts that pass the overlap check (`near_benchmark`; 7 of the 336 share a benchmark
    prompt's "Write a Python function that" 3-grams), in their fixed order."""
    return [text for _, text in distill_prompts() if not near_benchmark(text, bench)]


class Plan:
    """The shards a settings value asks for and the prompts of each (hand-written batches or Magpie chunks)."""

    def __init__(self, loaded: LoadedModel, settings: DistillSettings, folder: Path) -> None:
        from lab.app.builtin_prompts import BUILTIN_PROMPTS

        self.loaded, self.settings, self.folder = loaded, settings, folder
        bench = [p.text for p in BUILTIN_PROMPTS]
        self.handwritten = handwritten_prompts(bench)[: settings.limit]
        self.pool = PromptPool(bench, [t for _, t in distill_prompts()])
        size = settings.batch_size
        self.total = settings.magpie_chunks or -(-len(self.handwritten) // size)

    def prompts(self, index: int) -> dict:
        """{"prompt_source", "prompt_range" [first, end), "prompts"} of shard `index`; Magpie chunks in order."""
        if self.settings.prompts == "handwritten":
            first = index * self.settings.batch_size
            texts = self.handwritten[first : first + self.settings.batch_size]
            return {"prompt_source": "handwritten", "prompt_range": [first, first + len(texts)], "prompts": texts}
        path = self.folder / "prompts" / f"chunk_{index:05d}.json"
        if path.is_file():  # committed: authoritative; it joins the pool for the chunks after it
            texts = json.loads(path.read_text())
            for text in texts:
                self.pool.index.add(text)
        else:
            texts = self.pool.select(
                cached_candidates(self.loaded, self.folder / "candidates", index, self.settings.seed)
            )
            path.parent.mkdir(exist_ok=True)
            _write_atomically(path, json.dumps(texts, indent=0).encode())
        return {"prompt_source": "magpie", "prompt_range": [index, index + 1], "prompts": texts}


def run_store(
    loaded: LoadedModel, settings: DistillSettings, folder: Path, progress: Progress, max_shards: int | None = None
) -> list[int]:
    """Make the plan's missing shards (at most `max_shards`) in `folder`; returns the indices made by this run."""
    settings.check()
    if settings.layers:
        raise InputError("--layers does not go with --store: features are recomputed from the ids.")
    if loaded.vocab_size - 1 > MAX_ID:
        raise InputError(f"--store keeps ids as uint16; {loaded.spec} has {loaded.vocab_size} token ids.")
    plan = Plan(loaded, settings, folder)
    config = {
        "format": IDS_FORMAT,
        "settings": asdict(settings),
        "model_shape": model_shape(loaded),
        "precision": loaded.precision,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "shards": plan.total,
    }
    _check_config(folder, config)
    done, made = set(made_shards(folder)), []
    for index in range(plan.total):
        if settings.prompts == "magpie" or index not in done:
            prompts = plan.prompts(index)  # Magpie: every chunk, so the pool holds the prompts kept before
        if index in done:
            continue
        if max_shards is not None and len(made) >= max_shards:
            break
        made.append(index)
        start = time.perf_counter()
        encoded = [loaded.encode(text, chat=True) for text in prompts["prompts"]]
        records: list[Record] = respond(loaded, encoded, settings, settings.seed + index, False) if encoded else []
        pairs = [(prompt, response) for prompt, response, _ in records]
        blob = pack_ids(pairs)
        manifest = _manifest(loaded, settings, index, prompts, pairs, time.perf_counter() - start)
        manifest["npz_sha256"] = hashlib.sha256(blob).hexdigest()
        manifest["npz_bytes"] = len(blob)
        _write_atomically(folder / f"{shard_name(index)}.npz", blob)
        _write_atomically(folder / f"{shard_name(index)}.json", json.dumps(manifest, indent=1).encode())
        progress(
            index + 1,
            plan.total,
            f"{shard_name(index)}: {len(pairs)} sequences, {manifest['response_tokens']} response tokens, "
            f"{manifest['tokens_per_s']} tok/s, {len(blob) / 1e3:.1f} kB",
        )
    return made


def folder_summary(folder: Path) -> dict:
    """Totals of an ids folder from its manifests: shards made / planned, sequences, tokens, distinct prompts, bytes."""
    config = json.loads((Path(folder) / "config.json").read_text())
    manifests = [json.loads((Path(folder) / f"{shard_name(i)}.json").read_text()) for i in made_shards(folder)]
    prompts = [text for m in manifests for text in m["prompts"]]
    return {
        "folder": str(folder),
        "shards": f"{len(manifests)}/{config['shards']}",
        "sequences": sum(m["sequences"] for m in manifests),
        "response_tokens": sum(m["response_tokens"] for m in manifests),
        "prompt_tokens": sum(m["prompt_tokens"] for m in manifests),
        "distinct_prompts": len(set(prompts)),
        "npz_bytes": sum(m["npz_bytes"] for m in manifests),
    }


def stored_prompts(folder: Path) -> list[str]:
    """Every prompt text of the shards made in an ids folder (for the overlap check)."""
    manifests = [json.loads((Path(folder) / f"{shard_name(i)}.json").read_text()) for i in made_shards(folder)]
    return [text for manifest in manifests for text in manifest["prompts"]]
