"""Self-distillation data kept as token ids (lab.training.distill.store), features recomputed from them with a
checked cache (lab.training.distill.features), and training on them that resumes (tiny random models)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from lab.app.builtin_prompts import BUILTIN_PROMPTS
from lab.heads.checkpoint import Checkpoint
from lab.params import InputError
from lab.training.cli import TrainOptions
from lab.training.distill.batched import decode_batch
from lab.training.distill.cli import check_overlap
from lab.training.distill.dataset import load_distill
from lab.training.distill.features import folder_features
from lab.training.distill.generate import DistillSettings, run_distill
from lab.training.distill.store import folder_summary, handwritten_prompts, made_shards, pack_ids, read_ids, run_store
from tests.tiny import tiny_loaded_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _settings(**overrides) -> DistillSettings:
    base = {"model": "tiny", "max_new_tokens": 6, "batch_size": 2, "limit": 5, "top_k": 5, "samples": 1}
    return DistillSettings(**{**base, **overrides})


def _quiet(*_) -> None:
    return None


def test_ids_round_trip_and_ids_over_uint16_are_refused(tmp_path: Path) -> None:
    records = [([1, 2, 3], [4, 65535]), ([7], [8, 9, 10])]
    path = tmp_path / "s.npz"
    path.write_bytes(pack_ids(records))
    shard = read_ids(path)
    assert shard["tokens"].tolist() == [1, 2, 3, 4, 65535, 7, 8, 9, 10]
    assert shard["seq_offsets"].tolist() == [0, 5, 9] and shard["prompt_lengths"].tolist() == [3, 1]
    with np.load(path) as arrays:
        assert arrays["tokens"].dtype == np.uint16
    with pytest.raises(InputError, match="uint16"):
        pack_ids([([1], [65536])])


def test_store_writes_manifests_and_resumes_only_the_missing_shards(tiny, tmp_path: Path) -> None:
    settings = _settings()
    assert run_store(tiny, settings, tmp_path, _quiet, max_shards=1) == [0]  # plan: 3 shards of 2, 2, 1 prompts
    assert made_shards(tmp_path) == [0]
    assert run_store(tiny, settings, tmp_path, _quiet) == [1, 2]
    first = (tmp_path / "shard_00000.npz").read_bytes()
    manifest = json.loads((tmp_path / "shard_00000.json").read_text())
    assert manifest["npz_sha256"] == hashlib.sha256(first).hexdigest()
    assert manifest["model"] == "tiny-llama-0" and manifest["precision"] == tiny.precision
    assert manifest["dtype"] == "float32" and manifest["sampling"]["seed"] == 0
    assert manifest["sampling"]["temperature"] == 0.8 and manifest["prompt_range"] == [0, 2]
    texts = handwritten_prompts([p.text for p in BUILTIN_PROMPTS])
    assert len(texts) == 329 and manifest["prompts"] == texts[:2] and manifest["command"]
    # greedy then one sample per prompt; the greedy ids are what decode_batch gives
    shard = read_ids(tmp_path / "shard_00000.npz")
    assert manifest["sequences"] == 4 == len(shard["prompt_lengths"])
    assert manifest["response_tokens"] + manifest["prompt_tokens"] == len(shard["tokens"])
    encoded = [tiny.encode(text, chat=True) for text in manifest["prompts"]]
    greedy = decode_batch(tiny, encoded, 6)
    offsets = shard["seq_offsets"].tolist()
    assert shard["tokens"][: offsets[1]].tolist() == encoded[0] + greedy[0].response
    # a session that lost shard 1 makes only it again, bit for bit
    again = (tmp_path / "shard_00001.npz").read_bytes()
    (tmp_path / "shard_00001.json").unlink()
    assert run_store(tiny, settings, tmp_path, _quiet) == [1]
    assert (tmp_path / "shard_00001.npz").read_bytes() == again
    assert run_store(tiny, settings, tmp_path, _quiet) == []
    summary = folder_summary(tmp_path)
    assert summary["shards"] == "3/3" and summary["distinct_prompts"] == 5 and summary["sequences"] == 10
    with pytest.raises(InputError, match="other settings"):
        run_store(tiny, _settings(temperature=0.7), tmp_path, _quiet)
    with pytest.raises(InputError, match="--layers"):
        run_store(tiny, _settings(layers=(1,)), tmp_path / "other", _quiet)
    report = check_overlap(tmp_path)
    assert report["prompts"] == 5 == report["distinct"] and report["near_benchmark"] == []


def test_recomputed_features_match_the_rows_captured_while_generating(tiny, tmp_path: Path) -> None:
    settings = _settings(samples=0, layers=(1,), limit=4)  # the first 4 prompts pass the overlap check
    run_distill(tiny, settings, tmp_path / "captured", _quiet)
    run_store(tiny, _settings(samples=0, limit=4), tmp_path / "ids", _quiet)
    captured = load_distill(tmp_path / "captured", layers=(1,))
    with pytest.raises(InputError, match="token ids only"):
        load_distill(tmp_path / "ids", layers=(1,))
    recompute = lambda folder: folder_features(tiny, folder, 5, (1,), _quiet, tmp_path / "cache")  # noqa: E731
    ids = load_distill(tmp_path / "ids", layers=(1,), recompute=recompute)
    assert ids.rows == captured.rows and torch.equal(ids.next_token, captured.next_token)
    assert torch.equal(ids.prompt, captured.prompt) and torch.equal(ids.held_out(), captured.held_out())
    assert torch.allclose(ids.hidden.float(), captured.hidden.float(), atol=2e-2)
    assert torch.allclose(ids.features[1].float(), captured.features[1].float(), atol=2e-2)
    assert (ids.topk_ids[:, 0] == captured.topk_ids[:, 0]).float().mean() > 0.99
    assert torch.allclose(ids.topk_probs, captured.topk_probs, atol=2e-3)


def test_a_stale_feature_cache_is_named_and_recomputed(tiny, tmp_path: Path) -> None:
    run_store(tiny, _settings(limit=2), tmp_path / "ids", _quiet)
    cache = tmp_path / "cache"
    first = folder_features(tiny, tmp_path / "ids", 5, (), _quiet, cache)
    again = folder_features(tiny, tmp_path / "ids", 5, (), _quiet, cache, recompute=False)  # matches: read back
    assert torch.equal(first[0]["hidden"], again[0]["hidden"])
    other = replace(tiny_loaded_model(seed=1), spec=tiny.spec)  # same name, other weights
    with pytest.raises(InputError, match="weights_sha256") as error:
        folder_features(other, tmp_path / "ids", 5, (), _quiet, cache, recompute=False)
    assert "ids_sha256" not in str(error.value)
    with pytest.raises(InputError, match="top_k"):
        folder_features(tiny, tmp_path / "ids", 4, (), _quiet, cache, recompute=False)
    log: list[str] = []
    redone = folder_features(other, tmp_path / "ids", 5, (), log.append, cache)
    assert any("weights_sha256" in line and "recomputing" in line for line in log)
    assert not torch.equal(redone[0]["hidden"], first[0]["hidden"])
    # other ids under the same folder name: the hash of the ids differs
    (tmp_path / "ids" / "shard_00000.npz").write_bytes(pack_ids([([1, 2], [3, 4])]))
    with pytest.raises(InputError, match="ids_sha256"):
        folder_features(other, tmp_path / "ids", 5, (), _quiet, cache, recompute=False)


def test_a_cache_with_more_layers_serves_fewer(tiny, tmp_path: Path) -> None:
    """A shard cached with EAGLE-3's layers serves Medusa / MTPC (final hidden state only) without a recompute;
    a request for a layer the cache lacks is a mismatch naming `layers`."""
    run_store(tiny, _settings(limit=2), tmp_path / "ids", _quiet)
    cache = tmp_path / "cache"
    wide = folder_features(tiny, tmp_path / "ids", 5, (1,), _quiet, cache)
    log: list[str] = []
    narrow = folder_features(tiny, tmp_path / "ids", 5, (), log.append, cache, recompute=False)
    assert "hidden.1" in wide[0] and "hidden.1" not in narrow[0] and not any("recomputing" in x for x in log)
    assert torch.equal(wide[0]["hidden"], narrow[0]["hidden"])
    with pytest.raises(InputError, match="layers"):
        folder_features(tiny, tmp_path / "ids", 5, (0, 1), _quiet, cache, recompute=False)


class Stop(Exception):
    pass


def test_training_on_ids_resumes_to_the_uninterrupted_result(tmp_path: Path) -> None:
    from lab.training import eagle3_train

    loaded = tiny_loaded_model(seed=0, layers=8)
    layers = tuple(eagle3_train.data_layers(loaded))
    run_store(loaded, _settings(limit=6, batch_size=3, max_new_tokens=8, top_k=8), tmp_path / "ids", _quiet)
    data = load_distill(
        tmp_path / "ids", layers, lambda f: folder_features(loaded, f, 8, layers, _quiet, tmp_path / "cache")
    )
    options = TrainOptions(epochs=2, lr=3e-3, batch_size=4, draft_vocab=64, unroll=2, eval_every=2)

    def run(checkpoint: Checkpoint | None, log=_quiet):
        torch.manual_seed(0)
        head, _ = eagle3_train.train(loaded, data, options, log, checkpoint)
        return {name: p.detach().clone() for name, p in head.named_parameters()}

    reference = run(None)

    def interrupt(message: str) -> None:
        if message.startswith("checkpoint at step 3"):
            raise Stop

    path = tmp_path / "ckpt" / "eagle3.ckpt"
    with pytest.raises(Stop):
        run(Checkpoint(path, {"a": 1}, interrupt, every_s=0), interrupt)
    log: list[str] = []
    resumed = run(Checkpoint(path, {"a": 1}, log.append, every_s=0), log.append)
    assert any("resumed" in line and "step 3" in line for line in log)
    assert all(torch.equal(resumed[name], value) for name, value in reference.items())
    state = torch.load(path, weights_only=True)
    assert state["optimizer"]["state"] and state["step"] > 3
    curves = [json.loads(line) for line in path.with_suffix(".metrics.jsonl").read_text().splitlines()]
    assert [c["step"] for c in curves] == list(range(2, state["step"] + 1, 2)) and "top1@1" in curves[-1]["held_out"]


def test_train_heads_reads_an_ids_folder_through_its_feature_cache(tiny, tmp_path: Path, monkeypatch, capsys) -> None:
    from lab.engine import models
    from lab.engine.models import wrap_model
    from lab.tools.cli import main
    from tests.tiny import ByteTokenizer, tiny_llama

    run_store(tiny, _settings(limit=4), tmp_path / "ids", _quiet)
    loads: list[tuple] = []
    half = wrap_model(tiny_llama(0).to(torch.bfloat16), ByteTokenizer(), spec=tiny.spec)

    def load(*args):
        loads.append(args)
        return half if args[2] == "bfloat16" else tiny

    monkeypatch.setattr(models, "load_model", load)
    cache, out = tmp_path / "cache", tmp_path / "heads"
    argv = ["train-heads", "--kind", "medusa", "--data", str(tmp_path / "ids"), "--out", str(out), "--epochs", "1"]
    argv += ["--batch-size", "8", "--draft-vocab", "64", "--heads", "2", "--features-cache", str(cache)]
    argv += ["--checkpoint", str(tmp_path / "ckpt" / "medusa.ckpt"), "--model", "tiny"]
    assert main(argv) == 0
    assert ("tiny", "auto", "float32", "bf16") in loads  # the feature pass at the ids' dtype and precision
    assert sorted(p.name for p in (cache / "tiny-llama-0" / "ids").iterdir()) == [
        "shard_00000.safetensors",
        "shard_00001.safetensors",
    ]
    config = json.loads((out / "medusa.json").read_text())
    assert config["data"]["format"] == "token-ids/npz-uint16/v1" and config["heads"] == 2
    curves = (tmp_path / "ckpt" / "medusa.metrics.jsonl").read_text().splitlines()
    assert '"step": 0' in curves[0] and "top1" in curves[-1]
    assert main([*argv, "--no-recompute", "--features-dtype", "bfloat16"]) == 2  # the cache was made in float32
    assert "dtype ('float32', not 'bfloat16')" in capsys.readouterr().err


def test_magpie_shards_filter_against_the_prompts_kept_before_even_when_committed(tiny, tmp_path: Path) -> None:
    kept = ["How do I keep basil fresh in the kitchen for a week?", "What is the capital city of Portugal and why?"]
    chunks = [kept, [kept[0], "Can you explain why the sky looks blue at noon?"], ["no", "<|im_start|>user hi"]]
    for index, candidates in enumerate(chunks):  # cached candidates: the model does not write them again
        path = tmp_path / "candidates" / f"chunk_{index:05d}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(candidates))
    settings = _settings(prompts="magpie", magpie_chunks=3, limit=None, samples=0)
    assert run_store(tiny, settings, tmp_path, _quiet, max_shards=1) == [0]
    (tmp_path / "candidates" / "chunk_00000.json").unlink()  # chunk 0 now known from its committed prompts only
    assert run_store(tiny, settings, tmp_path, _quiet) == [1, 2]
    manifests = [json.loads((tmp_path / f"shard_0000{i}.json").read_text()) for i in range(3)]
    assert [m["prompts"] for m in manifests] == [kept, ["Can you explain why the sky looks blue at noon?"], []]
    assert manifests[2]["sequences"] == 0 and manifests[1]["prompt_range"] == [1, 2]
    shards = folder_features(tiny, tmp_path, 5, (), _quiet, tmp_path / "cache")
    assert [len(s["prompt_lengths"]) for s in shards] == [2, 1]  # the empty chunk has no features
