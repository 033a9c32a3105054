"""Self-distillation data: prompt set, generation into resumable shards, loading rows back (tiny random model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lab.app.builtin_prompts import BUILTIN_PROMPTS, CATEGORIES
from lab.params import InputError
from lab.training.distill.dataset import load_distill
from lab.training.distill.generate import DistillSettings, run_distill
from lab.training.distill.prompts import distill_prompts


def test_prompt_set_is_large_diverse_and_disjoint_from_the_benchmark() -> None:
    prompts = distill_prompts()
    texts = [text for _, text in prompts]
    assert len(texts) >= 300 and len(set(texts)) == len(texts)
    assert {category for category, _ in prompts} == set(CATEGORIES)
    assert not set(texts) & {p.text for p in BUILTIN_PROMPTS}
    assert prompts == distill_prompts()  # no randomness


def _settings(**overrides) -> DistillSettings:
    return DistillSettings(**{"model": "tiny", "max_new_tokens": 6, "batch_size": 2, "limit": 3, **overrides})


def _progress(log: list[str]):
    return lambda done, total, message: log.append(f"{done}/{total} {message}")


def test_generation_writes_shards_whose_rows_match_a_fresh_forward(tiny, tmp_path: Path) -> None:
    log: list[str] = []
    run_distill(tiny, _settings(top_k=5), tmp_path, _progress(log))
    assert sorted(p.name for p in tmp_path.glob("shard_*")) == ["shard_00000.safetensors", "shard_00001.safetensors"]
    assert log[-1].startswith("2/2")
    data = load_distill(tmp_path)
    assert data.hidden.shape == (data.rows, 64) and data.topk_ids.shape == (data.rows, 5)
    assert data.config["model_shape"] == {"hidden_size": 64, "vocab_size": 256, "num_layers": 2}
    # row 0: the last prompt token of the first sequence; its stored distribution is the model's own
    prompt = tiny.encode(distill_prompts()[0][1], chat=True)
    assert int(data.position[0]) == len(prompt) - 1 and int(data.token[0]) == prompt[-1]
    with torch.no_grad():
        logits = tiny.model(input_ids=torch.tensor([prompt])).logits[0, -1]
    top = torch.softmax(logits.float(), -1).topk(5)
    assert data.topk_ids[0].tolist() == top.indices.tolist()
    assert torch.allclose(data.topk_probs[0], top.values, atol=2e-3)
    assert int(data.next_token[0]) == int(top.indices[0])  # the first response is greedy
    rows, later = data.future_rows(2)
    assert bool((data.sequence[rows] == data.sequence[later]).all())
    assert bool((data.position[later] == data.position[rows] + 2).all())


def test_rerun_resumes_and_other_settings_are_refused(tiny, tmp_path: Path) -> None:
    run_distill(tiny, _settings(), tmp_path, _progress([]))
    first = (tmp_path / "shard_00001.safetensors").read_bytes()
    (tmp_path / "shard_00001.safetensors").unlink()
    log: list[str] = []
    run_distill(tiny, _settings(), tmp_path, _progress(log))
    assert "already done" in log[0] and "already done" not in log[1]
    assert (tmp_path / "shard_00001.safetensors").read_bytes() == first  # seeded per batch: same data
    with pytest.raises(InputError, match="other settings"):
        run_distill(tiny, _settings(max_new_tokens=7), tmp_path, _progress([]))


def test_bad_settings_and_missing_data_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="--samples"):
        _settings(samples=-1).check()
    with pytest.raises(InputError, match="No self-distillation data"):
        load_distill(tmp_path)
    with pytest.raises(InputError, match="--no-greedy"):
        _settings(greedy=False, samples=0).check()


def test_a_samples_only_folder_loads_beside_the_first(tiny, tmp_path: Path) -> None:
    run_distill(tiny, _settings(samples=0), tmp_path / "greedy", _progress([]))
    run_distill(tiny, _settings(samples=2, greedy=False, seed=7), tmp_path / "samples", _progress([]))
    greedy, samples = load_distill(tmp_path / "greedy"), load_distill(tmp_path / "samples")
    assert len(torch.unique(greedy.sequence)) == 3 and len(torch.unique(samples.sequence)) == 6
    both = load_distill([tmp_path / "greedy", tmp_path / "samples"])
    assert both.rows == greedy.rows + samples.rows
    assert torch.unique(both.sequence).tolist() == list(range(9))  # ids run on across folders
    assert [part["settings"]["greedy"] for part in both.config["parts"]] == [True, False]
    assert both.config["model_shape"] == greedy.config["model_shape"]
    run_distill(tiny, _settings(samples=1, top_k=4), tmp_path / "other_k", _progress([]))
    with pytest.raises(InputError, match="top-4"):
        load_distill([tmp_path / "greedy", tmp_path / "other_k"])


def test_a_folder_made_before_the_greedy_setting_still_resumes(tiny, tmp_path: Path) -> None:
    run_distill(tiny, _settings(), tmp_path, _progress([]))
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    del config["settings"]["greedy"]
    config_path.write_text(json.dumps(config))
    log: list[str] = []
    run_distill(tiny, _settings(), tmp_path, _progress(log))
    assert all("already done" in line for line in log)
