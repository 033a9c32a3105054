"""Draft-model pairs for vanilla SD and SSD: the presets, and a drafter with another tokenizer refused end to end.

Two tiny byte-level BPE tokenizers are built in code with the same size and special ids but different ids for
the same bytes, each saved with a tiny random Llama as a local model folder (what a Hub download looks like).
A drafter with the target's tokenizer is accepted (greedy speculative decoding equals greedy), one with the
other tokenizer is refused with a message saying why, before any drafting. The curated "draft model" presets
name exactly the known pairs and validate.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from lab.app import presets
from lab.engine.models import load_model
from lab.params import InputError, build_params
from lab.trace import TokenEmitted
from strategies import REGISTRY, collect, get_strategy

SPECIALS = ["<unk>", "<s>", "</s>"]


def byte_tokenizer(seed: int | None) -> PreTrainedTokenizerFast:
    """Specials at ids 0-2, then the 256 byte symbols in order (seed None) or shuffled (a different tokenizer)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if seed is not None:
        order = torch.randperm(len(alphabet), generator=torch.Generator().manual_seed(seed)).tolist()
        alphabet = [alphabet[i] for i in order]
    vocab = {s: i for i, s in enumerate(SPECIALS + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def save_model(folder, seed: int, tokenizer, layers: int = 2) -> str:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=2,
        bos_token_id=1,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    same = byte_tokenizer(None)
    return {
        "target": save_model(root / "target", 0, same),
        "draft": save_model(root / "draft", 1, same),
        "other": save_model(root / "other", 2, byte_tokenizer(7)),
    }


def run(strategy: str, loaded, prompt: list[int], **values) -> list[int]:
    s = get_strategy(strategy)
    events = collect(s.run(loaded, prompt, build_params(s.Params, values), torch.Generator().manual_seed(0)))
    return [e.token_id for e in events if isinstance(e, TokenEmitted)]


def test_the_tokenizers_really_differ(folders) -> None:
    a, b = byte_tokenizer(None), byte_tokenizer(7)
    assert len(a) == len(b) and (a.eos_token_id, a.bos_token_id) == (b.eos_token_id, b.bos_token_id)
    assert a("draft")["input_ids"] != b("draft")["input_ids"]
    assert a.decode(a("draft")["input_ids"]) == b.decode(b("draft")["input_ids"]) == "draft"


@pytest.mark.parametrize("strategy", ["speculative", "ssd"])
def test_same_tokenizer_drafter_is_lossless_and_another_is_refused(folders, strategy, one_thread) -> None:
    target = load_model(folders["target"], device="cpu", dtype="float32")
    prompt = target.encode("pairs of models", chat=False)
    plain = run("greedy", target, prompt, max_new_tokens=12)
    drafted = run(strategy, target, prompt, max_new_tokens=12, drafter="model", draft_model=folders["draft"])
    assert drafted == plain
    with pytest.raises(InputError, match=r"does not share the target .*a sample text encodes to different token ids"):
        run(strategy, target, prompt, max_new_tokens=12, drafter="model", draft_model=folders["other"])


def test_draft_presets_name_the_known_pairs() -> None:
    for name in ("speculative", "ssd"):
        params_cls = REGISTRY[name].Params
        labels = [p for p in presets.presets_for(name, params_cls) if p.startswith("draft model:")]
        drafts = [presets.preset_values(name, params_cls, p)["draft_model"] for p in labels]
        assert drafts == list(presets.DRAFT_PAIRS)
        assert all(presets.preset_values(name, params_cls, p)["drafter"] == "model" for p in labels)
    assert presets.DRAFT_PAIRS["Qwen/Qwen2.5-0.5B-Instruct"] == (
        "Qwen/Qwen2.5-1.5B-Instruct",
        "Qwen/Qwen2.5-7B-Instruct",
    )
    for draft, targets in presets.DRAFT_PAIRS.items():
        assert {draft, *targets} <= set(presets.MODELS)


def test_models_doc_covers_every_strategy_and_every_head_layout() -> None:
    from lab.app import learn
    from lab.heads.published import LAYOUTS

    text = learn.models_markdown()
    table = text.split("## Draft heads")[0].lower()
    labels = {"tot": "tree of thoughts", "rlm": "recursive lm", "speculative": "speculative, ssd", "ssd": "ssd"}
    assert all(labels.get(name, name) in table for name in REGISTRY), "a strategy is missing from docs/models.md"
    named = {
        "eagle": "SafeAILab EAGLE-1/2",
        "eagle3": "SafeAILab EAGLE-3",
        "speculators-eagle3": "speculators",
        "medusa": "FasterDecoding Medusa",
    }
    assert set(named) == set(LAYOUTS) and all(label in text for label in named.values())
