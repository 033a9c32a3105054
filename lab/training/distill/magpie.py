"""Magpie prompts (Xu et al. 2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with
Nothing"): the chat template up to the start of a user turn is fed to the model, which then writes the user's
message itself; sampling it (seeded) many times gives instructions without any network or seed data.

Here: the prefix is the template rendered around a sentinel user message and cut at the sentinel (so it works for
any chat template; SmolLM2's adds its default system prompt). Chunk c uses the system prompt
`SYSTEMS[c % len(SYSTEMS)]` (None: the template's default; the others steer the topic, Magpie's system-prompt
control, Sec. 2.3) and samples `CHUNK` messages at `TEMPERATURE` with the generator seeded by seed + c, up to
`MAX_PROMPT_TOKENS`, stopping at the end-of-turn token (a message that does not end is dropped). Each chunk's raw
messages are cached as JSON (`candidates/chunk_00012.json`), so a rerun does not write them again, and are then
filtered and de-duplicated against everything kept before, the hand-written set and the benchmark prompts
included (`lab.training.distill.prompt_filter.PromptPool`). Not covered: multi-turn Magpie, response-quality filters.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from lab.engine.models import LoadedModel
from lab.training.distill.batched import decode_batch

CHUNK = 64
TEMPERATURE = 1.0
MAX_PROMPT_TOKENS = 48
SENTINEL = "<<MAGPIE-SENTINEL>>"
SYSTEMS: tuple[str | None, ...] = (
    None,
    "You are a helpful assistant. Users ask you to write poems, stories, letters and other creative texts.",
    "You are a helpful assistant. Users ask you questions about science, nature and technology.",
    "You are a helpful assistant. Users ask you to solve math problems and puzzles step by step.",
    "You are a helpful assistant. Users ask you to write and explain Python code.",
    "You are a helpful assistant. Users ask you about history, geography, culture and society.",
    "You are a helpful assistant. Users ask you for practical advice about daily life, health, cooking and work.",
    "You are a helpful assistant. Users ask you to summarise, rewrite or extract information from a text.",
    "You are a helpful assistant. Users ask you to play a character or role.",
)


def magpie_prefix(loaded: LoadedModel, system: str | None) -> list[int]:
    """Token ids of the chat template up to where the user's message would start."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": SENTINEL}]
    text = loaded.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    return loaded.tokenizer(text[: text.index(SENTINEL)], add_special_tokens=False)["input_ids"]


def write_candidates(loaded: LoadedModel, chunk: int, seed: int) -> list[str]:
    """Chunk `chunk`'s raw user messages (those that ended with an end-of-turn token), decoded."""
    prefix = magpie_prefix(loaded, SYSTEMS[chunk % len(SYSTEMS)])
    generator = torch.Generator(device=loaded.device).manual_seed(seed + chunk)
    decoded = decode_batch(loaded, [prefix] * CHUNK, MAX_PROMPT_TOKENS, TEMPERATURE, generator)
    eos = set(loaded.eos_token_ids)
    return [loaded.decode(d.response[:-1]).strip() for d in decoded if d.response and d.response[-1] in eos]


def cached_candidates(loaded: LoadedModel, folder: Path, chunk: int, seed: int) -> list[str]:
    """The chunk's candidates from its cache file, written first when missing (atomically)."""
    path = folder / f"chunk_{chunk:05d}.json"
    if path.is_file():
        return json.loads(path.read_text())
    candidates = write_candidates(loaded, chunk, seed)
    folder.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(candidates, indent=0))
    os.replace(partial, path)
    return candidates
