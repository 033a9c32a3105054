"""The one emitter of every decode loop (the autoregressive loop, the chain and tree loops of the speculative
family): it appends the chosen tokens to the output, stops at EOS or the budget, streams the text through the
incremental detokenizer and yields one `TokenEmitted` per token with the top alternatives of the distribution the
token was chosen from (for draft-then-verify loops, by losslessness, the target's processed p at its position).

Covered: the run's clock (`start`, from which every event's `elapsed` counts), the tokens so far, the stop reason,
token texts decoded once per run. Not covered: which alternatives a method shows (the caller passes them, or the
rows they come from) and the method's own events.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

import torch

from lab.engine.models import LoadedModel
from lab.engine.sampling import top_tokens
from lab.engine.text import IncrementalDetokenizer
from lab.trace import TokenEmitted

TOP_ALTERNATIVES = 8  # per emitted token


@dataclass
class Emitter:
    """The text side of a run: tokens so far, the streaming detokenizer, token texts, the clock."""

    loaded: LoadedModel
    max_new_tokens: int
    start: float | None = None  # perf_counter() of the run's start; None = now

    def __post_init__(self) -> None:
        self.start = time.perf_counter() if self.start is None else self.start
        self.generated: list[int] = []
        self.stop_reason: str | None = None
        self.detokenizer = IncrementalDetokenizer(self.loaded.tokenizer)
        self.text_of = lru_cache(maxsize=8192)(self.loaded.token_text)

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def accept(self, token: int) -> None:
        """Append a token to the output and set the stop reason at EOS (kept) or the budget."""
        self.generated.append(token)
        if token in self.loaded.eos_token_ids:
            self.stop_reason = "eos"
        elif len(self.generated) >= self.max_new_tokens:
            self.stop_reason = "max_new_tokens"

    def token(self, step: int, token: int, source: str, top_ids: list[int], top_probs: list[float]) -> TokenEmitted:
        """Accept one token and return its TokenEmitted: its text (flushed at the stop) and its alternatives."""
        self.accept(token)
        text = self.detokenizer.push(token) + (self.detokenizer.flush() if self.stop_reason else "")
        texts, probs = [self.text_of(t) for t in top_ids], [round(p, 6) for p in top_probs]
        return TokenEmitted(step, token, text, source, self.elapsed, top_ids, texts, probs)

    def emit(self, step: int, tokens: list[int], sources: list[str], rows: torch.Tensor) -> Iterator[TokenEmitted]:
        """TokenEmitted per token (cut at EOS / budget); rows[i] = the processed logits token i was chosen from."""
        top = top_tokens(rows, TOP_ALTERNATIVES)
        top_probs = (top.logits - torch.logsumexp(rows, dim=-1, keepdim=True)).exp()
        ids_all, probs_all = top.ids.tolist(), top_probs.tolist()
        for i, token in enumerate(tokens):
            if self.stop_reason:
                return
            yield self.token(step, token, sources[i], ids_all[i], probs_all[i])
