"""The emitter of every draft-then-verify loop: appends a round's tokens to the output, stops at EOS or the budget,
streams the text through the incremental detokenizer and yields one `TokenEmitted` per token with the top
alternatives of the distribution it was chosen from (by losslessness, the target's processed p at its position)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

import torch

from lab.engine.models import LoadedModel
from lab.engine.text import IncrementalDetokenizer
from lab.trace import TokenEmitted

TOP_ALTERNATIVES = 8  # per emitted token


@dataclass
class Emitter:
    """The text side of a run: tokens so far, the streaming detokenizer, token texts, the clock."""

    loaded: LoadedModel
    max_new_tokens: int

    def __post_init__(self) -> None:
        self.start = time.perf_counter()
        self.generated: list[int] = []
        self.stop_reason: str | None = None
        self.detokenizer = IncrementalDetokenizer(self.loaded.tokenizer)
        self.text_of = lru_cache(maxsize=8192)(self.loaded.token_text)

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)

    def emit(self, step: int, tokens: list[int], sources: list[str], rows: torch.Tensor) -> Iterator[TokenEmitted]:
        """TokenEmitted per token (cut at EOS / budget); rows[i] = the processed logits token i was chosen from."""
        k = min(TOP_ALTERNATIVES, rows.shape[-1])
        top_logits, top_ids = torch.topk(rows, k, dim=-1)
        top_probs = (top_logits - torch.logsumexp(rows, dim=-1, keepdim=True)).exp()
        ids_all, probs_all = top_ids.tolist(), top_probs.tolist()
        for i, token in enumerate(tokens):
            if self.stop_reason:
                return
            self.generated.append(token)
            if token in self.loaded.eos_token_ids:
                self.stop_reason = "eos"
            elif len(self.generated) >= self.max_new_tokens:
                self.stop_reason = "max_new_tokens"
            text = self.detokenizer.push(token) + (self.detokenizer.flush() if self.stop_reason else "")
            ids = ids_all[i]
            texts, probs = [self.text_of(t) for t in ids], [round(p, 6) for p in probs_all[i]]
            yield TokenEmitted(step, token, text, sources[i], time.perf_counter() - self.start, ids, texts, probs)


def sources_of(n_accepted: int, last: str) -> list[str]:
    """Per emitted token of a round: 'accepted' for the kept draft tokens, then the last token's source."""
    return ["accepted"] * n_accepted + [last]
