"""The model calls of a Tree of Thoughts run, with the counters the paper reports (Yao et al. 2023, Sec. 4).

Two primitives; each call is what the paper counts as one LM query (per option set, or per sample):
- `score(prefix, suffix, options)`: log p(option | prefix + suffix) of every option string, in ONE forward.
  The suffix is a chain and the options form a token trie below it, run with tree attention
  (`lab.engine.tree_attention`, the mask Medusa / EAGLE use); log p(option) is the sum of its tokens' log-probabilities
  along its trie path. `score_many` puts several (suffix, options) queries into the same trie, so the value prompts of
  all candidates of a step (or the proposals of all frontier states) cost one forward; each query still counts
  as one model call.
  This is how thoughts are decoded under a constraint (Game of 24's legal moves: the distribution
  p(m) / sum_m' p(m') over the legal set, i.e. the model conditioned on producing a legal line, computed
  exactly instead of token-by-token masking, which renormalizes locally and so favours moves whose forced
  tokens the model finds unlikely), and how value / vote prompts are read (the next words " sure" / " likely"
  / " impossible", or " 1" ... " k").
- `sample(prefix, suffix, n, ...)`: n free-text completions, batched ancestral sampling at temperature T (the
  paper's i.i.d. thought sampler and the chain-of-thought baseline), stopped at a stop string or EOS.
Every prompt is raw text (no chat template), so any causal LM can be used. Each distinct `prefix` (the fixed
few-shot part of a prompt) is prefilled once per `CallModel` and its KV cache reused: a call runs only its
suffix and options, then crops the cache back.
Counters (`Usage`): model_calls (queries as above), tokens (positions the model actually ran: cached prefixes
once, then suffixes, trie nodes and sampled tokens; the paper counts API prompt + completion tokens, which
would count the prefix every call), forwards (model forward passes).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from lab.engine import runtime
from lab.engine.models import LoadedModel
from lab.engine.tree_attention import build_tree_attention

SAMPLE_BATCH = 16  # rows per batched sampling pass (bounds the copied KV cache)


@dataclass
class Usage:
    model_calls: int = 0
    tokens: int = 0
    forwards: int = 0


@dataclass
class _Prefix:
    state: runtime.DecodeState
    last_logits: torch.Tensor  # [V] after the prefix's last token


def build_trie(groups: list[tuple[list[int], list[list[int]]]]) -> tuple[list[int], list[int], list[list[tuple]]]:
    """One token trie over every (chain + option) sequence of every group, equal prefixes merged (the same
    context has the same KV). Returns the parent list (parents before children, -1 = after the prefix), the
    tokens, and per group per option the (chain end node, option end node) pair."""
    parents: list[int] = []
    tokens: list[int] = []
    children: dict[tuple[int, int], int] = {}

    def insert(node: int, ids: list[int]) -> int:
        for token in ids:
            if (node, token) not in children:
                children[node, token] = len(tokens)
                parents.append(node)
                tokens.append(token)
            node = children[node, token]
        return node

    spans = []
    for chain, options in groups:
        if any(not ids for ids in options):
            raise ValueError("an option must have at least one token")
        chain_end = insert(-1, chain)
        spans.append([(chain_end, insert(chain_end, ids)) for ids in options])
    return parents, tokens, spans


@dataclass
class CallModel:
    """One run's access to the model: prefix-cached scoring and sampling, with usage counters."""

    loaded: LoadedModel
    usage: Usage = field(default_factory=Usage)
    _prefixes: dict[str, _Prefix] = field(default_factory=dict)

    def encode(self, text: str) -> list[int]:
        return list(self.loaded.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def _prefix(self, text: str) -> _Prefix:
        if text not in self._prefixes:
            ids = self.encode(text)
            state, out = runtime.prefill(self.loaded, ids)
            self._prefixes[text] = _Prefix(state, out.logits[-1])
            self.usage.tokens += len(ids)
            self.usage.forwards += 1
        return self._prefixes[text]

    def score(self, prefix: str, suffix: str, options: list[str]) -> list[float]:
        """log p(option | prefix + suffix) for each option (full-sequence log-probabilities), one forward."""
        return self.score_many(prefix, [(suffix, options)])[0]

    def score_many(self, prefix: str, queries: list[tuple[str, list[str]]]) -> list[list[float]]:
        """`score` for several (suffix, options) queries sharing one prefix, all in ONE tree forward; counts
        one model call per query."""
        entry = self._prefix(prefix)
        groups = [(self.encode(suffix), [self.encode(o) for o in options]) for suffix, options in queries]
        parents, tokens, spans = build_trie(groups)
        start = entry.state.length
        out = runtime.verify_tree(entry.state, build_tree_attention(parents), tokens)  # [N, V]
        runtime.crop(entry.state, start)
        rows = torch.cat([entry.last_logits[None], out.logits])  # [N + 1, V]: row 0 = after the prefix
        parent_rows = torch.tensor(parents, device=rows.device) + 1  # [N]
        token_ids = torch.tensor(tokens, device=rows.device)[:, None]  # [N, 1]
        token_logp = rows[parent_rows].log_softmax(-1).gather(1, token_ids)[:, 0]  # [N]
        cumulative = token_logp.double().tolist()  # log p of the root-to-node path, filled in parent order
        for node, parent in enumerate(parents):
            if parent >= 0:
                cumulative[node] += cumulative[parent]
        self.usage.model_calls += len(queries)
        self.usage.tokens += len(tokens)
        self.usage.forwards += 1
        return [[cumulative[end] - (cumulative[chain] if chain >= 0 else 0.0) for chain, end in s] for s in spans]

    def sample(
        self,
        prefix: str,
        suffix: str,
        n: int,
        *,
        temperature: float,
        max_tokens: int,
        stops: tuple[str, ...],
        generator: torch.Generator,
    ) -> list[str]:
        """n completions of prefix + suffix sampled at `temperature`, each cut at its first stop string or EOS."""
        entry = self._prefix(prefix)
        start = entry.state.length
        suffix_ids = self.encode(suffix)
        last = entry.last_logits
        if suffix_ids:
            last = runtime.forward(entry.state, suffix_ids, last_only=True).logits[-1]  # [V]
            self.usage.tokens += len(suffix_ids)
            self.usage.forwards += 1
        texts = []
        try:
            for offset in range(0, n, SAMPLE_BATCH):
                rows = min(SAMPLE_BATCH, n - offset)
                texts += self._sample_rows(entry.state, last, rows, temperature, max_tokens, stops, generator)
        finally:
            runtime.crop(entry.state, start)
        self.usage.model_calls += n
        return texts

    @torch.inference_mode()
    def _sample_rows(
        self,
        state: runtime.DecodeState,
        last: torch.Tensor,
        rows: int,
        temperature: float,
        max_tokens: int,
        stops: tuple[str, ...],
        generator: torch.Generator,
    ) -> list[str]:
        """Batched ancestral sampling of `rows` continuations from a copy of the state's cache."""
        cache = copy.deepcopy(state.cache)
        cache.batch_repeat_interleave(rows)
        logits = last.expand(rows, -1)  # [rows, V]
        ids: list[list[int]] = [[] for _ in range(rows)]
        done = [False] * rows
        eos = set(self.loaded.eos_token_ids)
        for step in range(max_tokens):
            probs = (logits / temperature).softmax(-1)  # [rows, V]
            drawn = torch.multinomial(probs.to(generator.device), 1, generator=generator).to(logits.device)
            for row, token in enumerate(drawn[:, 0].tolist()):
                if not done[row]:
                    done[row] = token in eos or _stopped(self.loaded.decode(ids[row] + [token]), stops)
                    ids[row].append(token)
            if all(done) or step + 1 == max_tokens:
                break
            out, _ = runtime.model_forward(self.loaded, drawn, cache)
            logits = out[:, -1].float()  # [rows, V]
            self.usage.tokens += rows
            self.usage.forwards += 1
        return [_cut(self.loaded.decode(row), stops) for row in ids]

    def close(self) -> None:
        for entry in self._prefixes.values():
            entry.state.cache.reset()
        self._prefixes.clear()


def _stopped(text: str, stops: tuple[str, ...]) -> bool:
    return any(stop in text for stop in stops)


def _cut(text: str, stops: tuple[str, ...]) -> str:
    cut = min((text.find(s) for s in stops if s in text), default=len(text))
    return text[:cut]
