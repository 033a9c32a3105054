"""The self-distillation data committed under heads/data/ (token ids, lab.training.distill.store): every shard is
what its manifest says, and every prompt passes the overlap check against the benchmark prompts. Fast: reads the
committed files only, no model."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from lab.app.builtin_prompts import BUILTIN_PROMPTS
from lab.training.distill.prompt_filter import overlap_report
from lab.training.distill.store import handwritten_prompts, is_ids_folder, made_shards, read_ids, stored_prompts

DATA = Path(__file__).resolve().parents[1] / "heads" / "data"
FOLDERS = sorted(p for p in DATA.glob("*/*") if p.is_dir() and is_ids_folder(p))
BENCH = [p.text for p in BUILTIN_PROMPTS]


def test_the_hand_written_plan_passes_the_overlap_check() -> None:
    prompts = handwritten_prompts(BENCH)
    report = overlap_report(prompts, BENCH)
    assert report["near_benchmark"] == [] and report["distinct"] == len(prompts) >= 300


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_prompts_are_disjoint_from_the_benchmark(folder: Path) -> None:
    report = overlap_report(stored_prompts(folder), BENCH)
    assert report["prompts"] > 0 and report["near_benchmark"] == []


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_shards_match_their_manifests(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    for index in made_shards(folder):
        manifest = json.loads((folder / f"shard_{index:05d}.json").read_text())
        path = folder / f"shard_{index:05d}.npz"
        assert hashlib.sha256(path.read_bytes()).hexdigest() == manifest["npz_sha256"]
        shard = read_ids(path)
        assert len(shard["prompt_lengths"]) == manifest["sequences"]
        assert len(shard["tokens"]) == manifest["prompt_tokens"] + manifest["response_tokens"]
        assert int(shard["tokens"].max()) < config["model_shape"]["vocab_size"]
        assert manifest["model_shape"] == config["model_shape"] and manifest["precision"] == config["precision"]
