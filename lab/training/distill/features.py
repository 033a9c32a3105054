"""Head-training features recomputed from stored token ids (`lab.training.distill.store`), cached outside git.

The features are a pure function of the ids and the model: one teacher-forced pass over every sequence (prompt and
response, no sampling) gives, for every position p from the last prompt token to the one before the last token
(one row per response token, the rows `lab.training.distill.batched` captures while generating):
h_p = hidden_states[L] (after the final norm), hidden_states[l] for l in `layers` (EAGLE-3's three), and the top
`top_k` of softmax(z_p), z_p = lm_head(h_p); all fp16 but the ids. Sequences are sorted by length and right-padded
into batches of at most `batch_tokens` tokens (pads come after a sequence's tokens, so the causal mask alone keeps
them out of its rows); the forward is `lab.engine.lean_forward` for Llama models (the numbers of `model(...)`) and
`model(...)` otherwise, at the loaded model's precision and dtype (load it at the precision the heads will serve).
Batched kernels round differently from the generation pass's, so features match the captured ones to fp16-level
tolerance, not bit for bit.

Cache: `<cache_dir>/<model slug>/<folder name>/shard_00012.safetensors` (default cache_dir
~/.cache/decoding-lab/features, or $DECODING_LAB_FEATURES). Its metadata records what it was made from: the SHA-256 of
the shard's ids (`lab.training.distill.store.ids_sha256`), the model spec, a SHA-256 of its embedding weights, the
precision, dtype, top-k and layers. A cached shard is used only when every field matches; otherwise it is
recomputed (the log names the fields that differ), or, with `recompute=False`, InputError names them.
Not covered: features larger than memory (a shard is computed and held whole), multi-GPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DynamicCache

from lab.engine.lean_forward import lean_forward
from lab.engine.models import LoadedModel
from lab.heads.common import model_slug
from lab.params import InputError
from lab.training.distill.dataset import feature_keys
from lab.training.distill.store import ids_sha256, made_shards, read_ids, shard_name

DEFAULT_CACHE = Path(os.environ.get("DECODING_LAB_FEATURES", "~/.cache/decoding-lab/features")).expanduser()
BATCH_TOKENS = 4096
Log = Callable[[str], None]


def weights_sha256(loaded: LoadedModel) -> str:
    """A fingerprint of the model's weights: SHA-256 of its input embedding matrix (float, every precision)."""
    cached = getattr(loaded.model, "_lab_weights_sha256", None)
    if cached is None:
        weight = loaded.embeddings.weight.detach().float().cpu().contiguous()
        cached = hashlib.sha256(weight.numpy().tobytes()).hexdigest()
        loaded.model._lab_weights_sha256 = cached
    return cached


def _forward(loaded: LoadedModel, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """hidden_states of a fresh teacher-forced forward over ids [B, T]: (L + 1) x [B, T, H]."""
    if loaded.lean:
        _, hidden = lean_forward(
            loaded.model, ids, DynamicCache(config=loaded.config), logits_to_keep=1, output_hidden_states=True
        )
        return hidden
    return loaded.model(input_ids=ids, use_cache=False, output_hidden_states=True, logits_to_keep=1).hidden_states


def _batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Sequence indices grouped by length (longest first), each group within batch_tokens (padded)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for index in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= batch_tokens:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


@torch.inference_mode()
def teacher_forced(
    loaded: LoadedModel,
    shard: dict[str, torch.Tensor],
    top_k: int,
    layers: Sequence[int],
    batch_tokens: int = BATCH_TOKENS,
) -> dict[str, torch.Tensor]:
    """The rows of every sequence of an ids shard (module docstring), in sequence order: hidden [N, H],
    topk_ids [N, k] int32, topk_probs [N, k], hidden.<l> [N, H]."""
    tokens, offsets, prompt_lengths = shard["tokens"].long(), shard["seq_offsets"], shard["prompt_lengths"]
    sequences = [tokens[offsets[i] : offsets[i + 1]] for i in range(len(prompt_lengths))]
    per_sequence: list[dict[str, torch.Tensor]] = [{} for _ in sequences]
    for group in _batches([len(s) for s in sequences], batch_tokens):
        width = len(sequences[group[0]])
        ids = torch.zeros(len(group), width, dtype=torch.long)
        for row, index in enumerate(group):
            ids[row, : len(sequences[index])] = sequences[index]
        hidden = _forward(loaded, ids.to(loaded.device))
        for row, index in enumerate(group):
            span = slice(int(prompt_lengths[index]) - 1, len(sequences[index]) - 1)
            final = hidden[-1][row, span]  # [n, H]
            probs = torch.softmax(loaded.lm_head(final).float(), dim=-1).topk(top_k, dim=-1)
            rows = {
                "hidden": final.to(torch.float16).cpu(),
                "topk_ids": probs.indices.to(torch.int32).cpu(),
                "topk_probs": probs.values.to(torch.float16).cpu(),
            }
            rows.update({f"hidden.{layer}": hidden[layer][row, span].to(torch.float16).cpu() for layer in layers})
            per_sequence[index] = rows
    return {name: torch.cat([rows[name] for rows in per_sequence]) for name in per_sequence[0]}


def cache_key(loaded: LoadedModel, shard: dict[str, torch.Tensor], top_k: int, layers: Sequence[int]) -> dict[str, str]:
    """What a cached shard must have been made from (stored as its safetensors metadata)."""
    return {
        "ids_sha256": ids_sha256(shard),
        "model": loaded.spec,
        "weights_sha256": weights_sha256(loaded),
        "precision": loaded.precision,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "top_k": str(top_k),
        "layers": json.dumps(sorted(int(layer) for layer in layers)),
    }


def _covers(name: str, found: str | None, wanted: str) -> bool:
    """Whether a cached field serves the wanted one: equal, or for `layers` a superset (a shard cached with
    EAGLE-3's layers serves Medusa and MTPC, which read only the final hidden state)."""
    if name == "layers" and found is not None:
        return set(json.loads(found)) >= set(json.loads(wanted))
    return found == wanted


def _mismatch(path: Path, expected: dict[str, str]) -> list[str]:
    """The metadata fields of a cached shard that do not serve `expected` (["missing"] when there is no file)."""
    if not path.is_file():
        return ["missing"]
    with safe_open(str(path), framework="pt") as cached:
        found = cached.metadata() or {}
    return [
        f"{name} ({found.get(name)!r}, not {value!r})"
        for name, value in expected.items()
        if not _covers(name, found.get(name), value)
    ]


def cached_features(
    loaded: LoadedModel,
    ids_path: Path,
    cache_path: Path,
    top_k: int,
    layers: Sequence[int],
    log: Log,
    recompute: bool = True,
) -> dict[str, torch.Tensor]:
    """One ids shard with its features (the ids keys and the row keys), from the cache when it matches."""
    shard = read_ids(ids_path)
    expected = cache_key(loaded, shard, top_k, layers)
    differ = _mismatch(cache_path, expected)
    if not differ:
        wanted = set(feature_keys(layers))
        with safe_open(str(cache_path), framework="pt") as cached:
            return {**shard, **{key: cached.get_tensor(key) for key in cached.keys() if key in wanted}}  # noqa: SIM118
    if not recompute:
        raise InputError(f"The feature cache {cache_path} does not match {ids_path}: {'; '.join(differ)}.")
    if differ != ["missing"]:
        log(f"feature cache {cache_path} was made from other inputs: {'; '.join(differ)}; recomputing")
    started = time.perf_counter()
    rows = teacher_forced(loaded, shard, top_k, layers)
    seconds = time.perf_counter() - started
    count = int(rows["hidden"].shape[0])
    log(f"{ids_path.name}: {count:,} rows of features in {seconds:.1f} s ({count / max(seconds, 1e-9):,.0f} rows/s)")
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    partial = cache_path.with_name(cache_path.name + ".partial")
    save_file(rows, str(partial), metadata=expected)
    os.replace(partial, cache_path)
    return {**shard, **rows}


def folder_features(
    loaded: LoadedModel,
    folder: Path,
    top_k: int,
    layers: Sequence[int],
    log: Log,
    cache_dir: Path = DEFAULT_CACHE,
    recompute: bool = True,
) -> list[dict[str, torch.Tensor]]:
    """Every made shard of an ids folder with its features (what `lab.training.distill.dataset` reads)."""
    folder = Path(folder)
    shards = made_shards(folder)
    if not shards:
        raise InputError(f"No token-id shards in {folder}; make them with `python -m lab distill --store {folder}`.")
    base = Path(cache_dir) / model_slug(loaded.spec) / folder.resolve().name
    out = []
    for index in shards:
        name = shard_name(index)
        if json.loads((folder / f"{name}.json").read_text())["sequences"] == 0:
            continue  # a Magpie chunk none of whose prompts passed the filters
        out.append(
            cached_features(loaded, folder / f"{name}.npz", base / f"{name}.safetensors", top_k, layers, log, recompute)
        )
    if not out:
        raise InputError(f"The token-id shards in {folder} hold no sequence.")
    log(f"features of {len(out)} shards of {folder} ready (cache {base})")
    return out
