"""Baseline strategies (greedy, sample) end to end, and streaming detokenization.

Unit part on the tiny random Llama; the integration part (marked `embedded`) checks the lab's greedy output
against `model.generate` on the embedded SmolLM2 in fp32, token for token.
"""

from __future__ import annotations

import pytest
import torch

from lab.app.builtin_prompts import BUILTIN_PROMPTS
from lab.engine.text import IncrementalDetokenizer
from lab.params import build_params
from lab.trace import RunFinished, TokenEmitted
from strategies import collect, get_strategy
from tests.tiny import tiny_loaded_model

GREEDY = get_strategy("greedy")
SAMPLE = get_strategy("sample")


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def run(strategy, loaded, prompt_ids: list[int], seed: int = 0, **values) -> list:
    params = build_params(strategy.Params, values)
    return collect(strategy.run(loaded, prompt_ids, params, gen(seed)))


def tokens_of(events: list) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEmitted)]


def manual_greedy(loaded, prompt_ids: list[int], n: int) -> list[int]:
    """Reference: argmax over a full no-cache forward of the whole sequence at every step."""
    ids = list(prompt_ids)
    out = []
    with torch.inference_mode():
        for _ in range(n):
            logits = loaded.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]  # [V]
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
            if token in loaded.eos_token_ids:
                break
    return out


@pytest.fixture(scope="module")
def prompt_ids(tiny) -> list[int]:
    return tiny.encode("The lab decodes", chat=False)


def test_greedy_equals_manual_argmax_loop(tiny, prompt_ids) -> None:
    events = run(GREEDY, tiny, prompt_ids, max_new_tokens=20)
    expected = manual_greedy(tiny, prompt_ids, 20)
    assert tokens_of(events) == expected
    assert len(set(expected)) > 1  # not a degenerate constant output


def test_greedy_ignores_the_seed(tiny, prompt_ids) -> None:
    assert tokens_of(run(GREEDY, tiny, prompt_ids, seed=1, max_new_tokens=8)) == tokens_of(
        run(GREEDY, tiny, prompt_ids, seed=2, max_new_tokens=8)
    )


def test_greedy_events(tiny, prompt_ids) -> None:
    events = run(GREEDY, tiny, prompt_ids, max_new_tokens=12)
    emitted = [e for e in events if isinstance(e, TokenEmitted)]
    assert [e.step for e in emitted] == list(range(len(emitted)))
    assert all(e.source == "target" for e in emitted)
    for e in emitted:
        assert e.top_ids[0] == e.token_id  # the argmax is the most likely alternative
        assert len(e.top_ids) == len(e.top_tokens) == len(e.top_probs) == 8
        assert e.top_tokens[0] == tiny.token_text(e.token_id)
    assert isinstance(events[-1], RunFinished)
    assert sum(isinstance(e, RunFinished) for e in events) == 1


def test_sample_same_seed_same_tokens(tiny, prompt_ids) -> None:
    first = run(SAMPLE, tiny, prompt_ids, seed=11, max_new_tokens=16)
    second = run(SAMPLE, tiny, prompt_ids, seed=11, max_new_tokens=16)
    assert tokens_of(first) == tokens_of(second)
    other = run(SAMPLE, tiny, prompt_ids, seed=12, max_new_tokens=16)
    assert tokens_of(first) != tokens_of(other)


def test_sample_top_probs_sorted_and_bounded(tiny, prompt_ids) -> None:
    events = run(SAMPLE, tiny, prompt_ids, seed=3, max_new_tokens=10, temperature=1.0, top_k=0, top_p=1.0)
    for e in (e for e in events if isinstance(e, TokenEmitted)):
        assert len(e.top_probs) == 8
        assert sum(e.top_probs) <= 1.0 + 1e-5
        assert all(0.0 <= p <= 1.0 for p in e.top_probs)
        assert e.top_probs == sorted(e.top_probs, reverse=True)


def test_sample_top_k_truncates_the_reported_distribution(tiny, prompt_ids) -> None:
    events = run(SAMPLE, tiny, prompt_ids, seed=5, max_new_tokens=10, temperature=1.0, top_k=3, top_p=1.0)
    for e in (e for e in events if isinstance(e, TokenEmitted)):
        assert e.token_id in e.top_ids[:3]
        assert e.top_probs[3:] == [0.0] * 5
        assert sum(e.top_probs) == pytest.approx(1.0, abs=1e-5)
        assert e.top_probs == sorted(e.top_probs, reverse=True)


@pytest.mark.parametrize("strategy", [GREEDY, SAMPLE], ids=["greedy", "sample"])
def test_run_finished_counts_one_forward_per_token(tiny, prompt_ids, strategy) -> None:
    events = run(strategy, tiny, prompt_ids, seed=4, max_new_tokens=9)
    finished = events[-1]
    assert isinstance(finished, RunFinished)
    n = len(tokens_of(events))
    assert finished.target_forwards == n
    assert finished.step == n
    assert finished.prompt_tokens == len(prompt_ids)
    assert finished.draft_forwards == 0
    assert finished.stop_reason == ("eos" if tokens_of(events)[-1] in tiny.eos_token_ids else "max_new_tokens")
    assert finished.wall_s >= 0


def test_eos_stops_the_run(prompt_ids) -> None:
    """A fresh copy of the tiny model whose EOS is the 4th greedy token: the run stops right after emitting it."""
    loaded = tiny_loaded_model(seed=0)
    reference = manual_greedy(loaded, prompt_ids, 6)
    assert 0 not in reference[:4]
    loaded.model.generation_config.eos_token_id = reference[3]
    assert reference[3] not in reference[:3]
    events = run(GREEDY, loaded, prompt_ids, max_new_tokens=20)
    assert tokens_of(events) == reference[:4]
    assert events[-1].stop_reason == "eos"
    assert events[-1].target_forwards == 4


def test_closing_the_stream_early(tiny, prompt_ids) -> None:
    params = build_params(SAMPLE.Params, {"max_new_tokens": 50})
    stream = SAMPLE.run(tiny, prompt_ids, params, gen(0))
    first = [next(stream), next(stream)]
    assert all(isinstance(e, TokenEmitted) for e in first)
    stream.close()
    with pytest.raises(StopIteration):
        next(stream)
    # The same seed started afresh gives the same first tokens (no state leaked from the closed run).
    again = run(SAMPLE, tiny, prompt_ids, seed=0, max_new_tokens=2)
    assert tokens_of(again) == [e.token_id for e in first]


def test_streamed_text_is_the_decoded_text(tiny, prompt_ids) -> None:
    events = run(SAMPLE, tiny, prompt_ids, seed=9, max_new_tokens=24)
    streamed = "".join(e.text for e in events if isinstance(e, TokenEmitted))
    full = tiny.tokenizer.decode(tokens_of(events), skip_special_tokens=True)
    assert streamed == full  # the last token flushes any held-back incomplete character


# --- IncrementalDetokenizer -----------------------------------------------------------------------------------


def detokenize(tokenizer, ids: list[int]) -> tuple[list[str], str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push(i) for i in ids]
    return pieces, detokenizer.flush()


def test_detokenizer_on_split_utf8_bytes(tiny) -> None:
    ids = list("naïve café 日本語 🙂".encode())
    pieces, tail = detokenize(tiny.tokenizer, ids)
    assert "".join(pieces) + tail == "naïve café 日本語 🙂"
    assert tail == ""
    assert not any("\ufffd" in piece for piece in pieces)
    emoji_start = len("naïve café 日本語 ".encode())
    assert pieces[emoji_start : emoji_start + 3] == ["", "", ""] and pieces[emoji_start + 3] == "🙂"


def test_detokenizer_flush_returns_held_back_tail(tiny) -> None:
    ids = list("ok 🙂".encode())[:-1]  # the emoji's last byte is missing
    pieces, tail = detokenize(tiny.tokenizer, ids)
    assert "".join(pieces) == "ok "
    assert "".join(pieces) + tail == tiny.tokenizer.decode(ids)


@pytest.mark.embedded
@pytest.mark.parametrize(
    "text", ["naïve café 日本語 🙂", "I don't know , really . Isn't it ?", "  two  spaces\n\nand 🙂🙂 emoji"]
)
def test_detokenizer_embedded_tokenizer(embedded, text: str) -> None:
    tokenizer = embedded.tokenizer
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces, tail = detokenize(tokenizer, ids)
    assert "".join(pieces) + tail == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in piece for piece in pieces)
    truncated = ids[:-1]
    pieces, tail = detokenize(tokenizer, truncated)
    assert "".join(pieces) + tail == tokenizer.decode(truncated, skip_special_tokens=True)


# --- integration: the embedded model ------------------------------------------------------------------------


@pytest.mark.embedded
@pytest.mark.parametrize("prompt", BUILTIN_PROMPTS[:5], ids=lambda p: p.text[:24])
def test_greedy_matches_hf_generate(embedded, prompt) -> None:
    assert embedded.dtype == torch.float32
    prompt_ids = embedded.encode(prompt.text, chat=True)
    with torch.inference_mode():
        output = embedded.model.generate(
            torch.tensor([prompt_ids], device=embedded.device), do_sample=False, max_new_tokens=64
        )
    expected = output[0, len(prompt_ids) :].tolist()
    events = run(GREEDY, embedded, prompt_ids, max_new_tokens=64)
    assert tokens_of(events) == expected
    assert events[-1].target_forwards == len(expected)
