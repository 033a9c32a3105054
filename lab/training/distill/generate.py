"""Self-distillation data: the model's own responses to a prompt set, with its hidden states and top-k next-token
distributions, stored for training draft heads (Medusa, MTPC, EAGLE-1, EAGLE-3) with the base model frozen.

Prompt sources (`prompts`): "handwritten", the 336 instructions of `lab.training.distill.prompts` (`limit`: the first
K), or "magpie", `magpie_chunks` chunks of user messages the model writes itself (`lab.training.distill.magpie`), each
chunk filtered against the benchmark prompts, the hand-written set and every prompt kept before it; the kept prompts
of chunk c are stored in `prompts/chunk_c.json` and answered in shard c.
Per prompt (chat template on): one greedy response (unless `greedy` is off) and `samples` sampled ones
(temperature `temperature`, no top-k/top-p), up to `max_new_tokens`, cut after the first EOS (kept: heads learn
to stop). Responses come from `lab.training.distill.batched.decode_batch`, `rows` sequences at a time (every variant
of the batch's prompts in one call; unpadded batched steps on the native path, else a left-padded batch), which stores
in the same pass, for every position p from the last prompt token to the one before the last token (one row per response
token): h_p = hidden_states[L] (after the final norm, fp16), the top `top_k` of softmax(z_p) (temperature 1), and
for every l in `layers` the input of layer l, hidden_states[l] (fp16, key `hidden.<l>`; "eagle3" = 2, L // 2, L - 3).

Work is split into shards (`shard_00012.safetensors`, `batch_size` prompts each for the hand-written set) written
atomically, so an interrupted run resumes where it stopped. `config.json` records the settings and the model
shape; a rerun with other settings into the same folder is refused. Sampling draws from a `torch.Generator`
seeded by seed + shard index, so the data is reproducible on the same machine and software (batched kernels may
differ in the last bits across machines and batch sizes). Not covered: multi-turn data, datasets from the Hub
(no network here), packing.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from safetensors.torch import save_file

from lab.engine.models import LoadedModel
from lab.heads.common import model_shape
from lab.params import InputError
from lab.training.distill.batched import Capture, decode_batch
from lab.training.distill.magpie import cached_candidates
from lab.training.distill.prompt_filter import PromptPool
from lab.training.distill.prompts import distill_prompts

Progress = Callable[[int, int, str], None]
PROMPT_SOURCES = ("handwritten", "magpie")


@dataclass(frozen=True)
class DistillSettings:
    """What the data depends on; stored in config.json and compared on resume."""

    model: str
    max_new_tokens: int = 256
    samples: int = 1
    temperature: float = 0.8
    top_k: int = 32
    batch_size: int = 8
    rows: int = 16  # sequences decoded together (lab.training.distill.batched.decode_batch's width)
    seed: int = 0
    limit: int | None = None
    greedy: bool = True  # off: sampled responses only (more data beside a folder that has the greedy ones)
    prompts: str = "handwritten"  # or "magpie"
    magpie_chunks: int = 0  # Magpie chunks (= shards) to write
    layers: tuple[int, ...] = ()  # extra hidden_states[l] stored per row (EAGLE-3: 2, L // 2, L - 3)

    def check(self) -> None:
        if not 1 <= self.max_new_tokens <= 4096:
            raise InputError("--max-new-tokens must be between 1 and 4096.")
        if not 0 <= self.samples <= 16:
            raise InputError("--samples must be between 0 and 16.")
        if not self.greedy and self.samples == 0:
            raise InputError("--no-greedy needs --samples of at least 1.")
        if not 0.05 <= self.temperature <= 5:
            raise InputError("--temperature must be between 0.05 and 5.")
        if not 1 <= self.top_k <= 256 or not 1 <= self.batch_size <= 256 or not 1 <= self.rows <= 256:
            raise InputError("--top-k, --batch-size and --rows must be between 1 and 256.")
        if self.limit is not None and self.limit < 1:
            raise InputError("--limit must be at least 1.")
        if self.prompts not in PROMPT_SOURCES or (self.prompts == "magpie") != (self.magpie_chunks > 0):
            raise InputError("--prompts must be handwritten or magpie, and --magpie-chunks > 0 goes with magpie.")


def eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """The low, middle and high features EAGLE-3 fuses: inputs of layers 2, L // 2 and L - 3 (Li et al. 2025)."""
    return (2, num_layers // 2, num_layers - 3)


Record = tuple[list[int], list[int], dict[str, torch.Tensor]]


def respond(
    loaded: LoadedModel, encoded: list[list[int]], settings: DistillSettings, seed: int, capture: bool = True
) -> list[Record]:
    """Every response variant (greedy, then the samples) to a batch of encoded prompts, with its captured rows
    (`capture` off: the token ids only, with empty row dicts)."""
    generator = torch.Generator(device=loaded.device).manual_seed(seed)
    rows = Capture(settings.top_k, settings.layers) if capture else None
    variants = range(0 if settings.greedy else 1, 1 + settings.samples)  # 0: greedy, then the samples
    prompts = [prompt for _ in variants for prompt in encoded]
    temperatures = [settings.temperature if variant > 0 else 0.0 for variant in variants for _ in encoded]
    limit = settings.max_new_tokens
    decoded = decode_batch(loaded, prompts, limit, temperatures, generator, rows, width=settings.rows)
    return [(prompt, d.response, d.tensors) for prompt, d in zip(prompts, decoded, strict=True)]


def _shard_tensors(records: list[Record]) -> dict[str, torch.Tensor]:
    """Concatenate one shard's sequences: tokens with offsets, prompt lengths, per-row tensors."""
    tokens = [torch.tensor(prompt + response, dtype=torch.int32) for prompt, response, _ in records]
    offsets = torch.tensor([0] + [len(t) for t in tokens], dtype=torch.int64).cumsum(0)
    rows = {name: torch.cat([r[name] for _, _, r in records]) for name in records[0][2]}
    return {
        "tokens": torch.cat(tokens),
        "seq_offsets": offsets,
        "prompt_lengths": torch.tensor([len(p) for p, _, _ in records], dtype=torch.int32),
        **rows,
    }


def _check_config(out_dir: Path, config: dict) -> None:
    path = out_dir / "config.json"
    config = json.loads(json.dumps(config))  # tuples as lists, as read back
    if path.exists():
        existing = json.loads(path.read_text())
        defaults = {f.name: f.default for f in fields(DistillSettings) if f.name != "model"}
        for name, value in json.loads(json.dumps(defaults)).items():  # folders made before a setting existed
            existing.get("settings", {}).setdefault(name, value)
        if existing != config:
            raise InputError(f"{out_dir} holds data made with other settings ({existing}); choose another --out.")
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config, indent=2))


def _save_shard(shard: Path, records: list[Record]) -> int:
    """Write the shard atomically (an empty marker file when no prompt survived); returns its response tokens."""
    if not records:
        shard.with_suffix(".empty").touch()
        return 0
    partial = shard.with_suffix(".partial")
    save_file(_shard_tensors(records), str(partial))
    os.replace(partial, shard)
    return sum(len(response) for _, response, _ in records)


def _magpie_prompts(loaded: LoadedModel, settings: DistillSettings, out_dir: Path, pool: PromptPool, chunk: int):
    """Chunk `chunk`'s kept prompts, stored in prompts/chunk_c.json (filtering is deterministic, so resumable)."""
    kept = pool.select(cached_candidates(loaded, out_dir / "candidates", chunk, settings.seed))
    path = out_dir / "prompts" / f"chunk_{chunk:05d}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(kept, indent=0))
    return kept


def run_distill(loaded: LoadedModel, settings: DistillSettings, out_dir: Path, progress: Progress) -> Path:
    """Generate (or resume) the data set into `out_dir`; returns the folder."""
    from lab.app.builtin_prompts import BUILTIN_PROMPTS

    settings.check()
    handwritten = [text for _, text in distill_prompts()][: settings.limit]
    config = {"settings": asdict(settings), "model_shape": model_shape(loaded)}
    if settings.prompts == "handwritten":
        config["prompts"] = len(handwritten)
        batches = [handwritten[i : i + settings.batch_size] for i in range(0, len(handwritten), settings.batch_size)]
        total = len(batches)
    else:
        pool = PromptPool([p.text for p in BUILTIN_PROMPTS], [t for _, t in distill_prompts()])
        total = settings.magpie_chunks
    _check_config(out_dir, config)
    tokens, start = 0, time.perf_counter()
    for index in range(total):
        shard = out_dir / f"shard_{index:05d}.safetensors"
        batch = batches[index] if settings.prompts == "handwritten" else None
        done = shard.exists() or shard.with_suffix(".empty").exists()
        if batch is None:  # always selected (candidates are cached), so the pool is complete on resume
            batch = _magpie_prompts(loaded, settings, out_dir, pool, index)
        if done:
            progress(index + 1, total, f"{shard.name} already done")
            continue
        t0 = time.perf_counter()
        records = respond(loaded, [loaded.encode(text, chat=True) for text in batch], settings, settings.seed + index)
        new = _save_shard(shard, records)
        tokens += new
        rate, overall = new / (time.perf_counter() - t0), tokens / (time.perf_counter() - start)
        progress(
            index + 1,
            total,
            f"{shard.name}: {len(batch)} prompts, {new} response tokens, {rate:.1f} tok/s "
            f"(this run: {tokens} tokens, {overall:.1f} tok/s)",
        )
    return out_dir
