"""Vanilla speculative decoding (Leviathan et al. 2023, Alg. 1; Chen et al. 2023) with three drafters.

Each round: 1. a proposer (`lab.proposers`) drafts up to gamma tokens x_1..x_gamma with distributions q_i
(prompt lookup: deterministic, q = None; self-draft: the target's first L layers + final norm + LM head; model:
any causal LM with the target's tokenizer), 2. the target scores [x_0, x_1..x_gamma] in one forward
(`lab.proposers.verify_draft`), 3. `lab.sampling.accept_draft` keeps x_i with probability min(1, p_i(x_i) /
q_i(x_i)), resamples the first rejected position from norm(max(0, p_i - q_i)), or draws a bonus token from
p_gamma when all are kept, 4. both KV caches roll back to the kept prefix (`lab.runtime.crop`), 5. the round's
`DraftRound`, its two `PipelineSpan`s (draft then verify, serial: the timeline SSD's is compared with) and one
`TokenEmitted` per token (source accepted / recovered / bonus) stream out, 6. gamma adapts.

Losslessness with processors: p_i = softmax(process(z_target)), the exact distribution `strategies.sample`
draws from at that position (repetition penalty over the history plus x_1..x_i), and q_i is the distribution
x_i was really drawn from (the draft logits through the same processors). Alg. 1 outputs tokens distributed
exactly as p for any q with x ~ q (Leviathan et al. 2023, Thm. 3.5), so the processors change what is sampled
(as in plain sampling), never the guarantee; using the same processors on q only raises acceptance. In greedy
mode (temperature 0) p and q are one-hot argmaxes (`target_distribution`): a draft token is kept iff it is the
target's argmax, so the output equals greedy decoding token for token (up to float ties: batched verify
logits can differ from one-token logits in the last bits; tested equal in fp32 on the builtin prompts).
Sampling mode matches the target's distribution but not `sample`'s tokens for the same seed (other draws).

Adaptive gamma (a documented heuristic, like HF's assisted generation which uses +2 / -1): after a fully
accepted non-empty draft gamma grows by 1 up to gamma_max, after a rejection it shrinks by 1 down to 1; an
empty draft (no prompt-lookup match) leaves it alone. gamma is always clipped to the remaining budget - 1.
TokenEmitted alternatives are the top 8 of softmax(processed target logits) at that position, for every
source (by losslessness it is the distribution each token is marginally drawn from).
Not covered: tree drafts (EAGLE, Medusa), SSD's asynchronous scheduling, batched sequences, drafters with
another tokenizer, typical acceptance (lossy).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from lab import runtime
from lab.models import LoadedModel
from lab.params import DecodeParams, param
from lab.profile import section
from lab.proposers import DRAFTERS, Draft, DraftContext, Proposer, Verification, make_proposer, verify_draft
from lab.sampling import SamplingConfig
from lab.text import IncrementalDetokenizer
from lab.trace import DraftRound, Event, PipelineSpan, RunFinished, TokenEmitted
from strategies.base import Strategy

TOP_ALTERNATIVES = 8  # per emitted token (TokenEmitted)
TOP_DETAIL = 5  # per drafted position and for the residual (DraftRound)


@dataclass(frozen=True)
class SpeculativeParams(DecodeParams):
    drafter: str = param(
        "prompt-lookup",
        choices=DRAFTERS,
        help="Who drafts: n-gram lookup in the text (q = None), the target's first L layers, or a draft model.",
    )
    gamma: int = param(6, low=1, high=16, help="Draft length gamma: tokens proposed per target forward (at most).")
    adaptive: bool = param(False, help="Adapt gamma: +1 after a fully accepted draft, -1 after a rejection.")
    gamma_max: int = param(12, low=1, high=32, help="Upper bound of adaptive gamma (the start is clipped to it).")
    draft_model: str = param(
        "", help="drafter=model: a Hugging Face id or path with the same tokenizer (empty = target)."
    )
    draft_layers: int = param(8, low=1, high=256, help="drafter=self-draft: L, the target's first L layers draft.")
    max_ngram: int = param(4, low=1, high=8, help="drafter=prompt-lookup: longest suffix n-gram searched for.")
    lookup_scaling: bool = param(
        True, help="drafter=prompt-lookup: draft at most 2n - 1 tokens after a match of n tokens (else gamma)."
    )
    temperature: float = param(0.0, low=0.0, high=2.0, help="p = softmax(z / T) for target and draft (0 = greedy).")
    top_k: int = param(0, low=0, high=1000, help="Keep the k most likely tokens of p and q (0 = off).")
    top_p: float = param(1.0, low=0.05, high=1.0, help="Nucleus on p and q: smallest top set with mass >= top_p.")
    min_p: float = param(0.0, low=0.0, high=0.5, help="Drop tokens with p < min_p * p_max (0 = off).")
    repetition_penalty: float = param(
        1.0, low=1.0, high=2.0, help="Seen tokens: z / r if z > 0 else z * r, on target and draft (1 = off)."
    )

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty)


def next_gamma(gamma: int, drafted: int, accepted: int, params: SpeculativeParams) -> int:
    """Adaptive draft length: +1 on full acceptance (up to gamma_max), -1 on a rejection (down to 1)."""
    if not params.adaptive or drafted == 0:
        return gamma
    return min(gamma + 1, params.gamma_max) if accepted == drafted else max(gamma - 1, 1)


def cut_at_eos(draft: Draft, eos_ids: tuple[int, ...]) -> Draft:
    """Drop draft tokens after the first EOS (the target would stop there)."""
    for i, token in enumerate(draft.tokens):
        if token in eos_ids:
            return draft.truncated(i + 1)
    return draft


def _top(values: torch.Tensor, k: int, v: Verification) -> tuple[list[int], list[float]]:
    """Token ids and values of the k largest entries (> 0) of a row of p or q columns."""
    top = torch.topk(values, min(k, values.shape[-1]))
    pairs = [(v.token(c), x) for c, x in zip(top.indices.tolist(), top.values.tolist(), strict=True) if x > 0]
    return [t for t, _ in pairs], [round(x, 6) for _, x in pairs]


def _alternatives(v: Verification, n: int, texts: Callable[[int], str]) -> tuple[list, list, list]:
    """Per drafted position: texts, p and q of the top tokens of p + q."""
    alt_texts, alt_p, alt_q = [], [], []
    if n:
        columns = torch.topk(v.p[:n] + v.q, min(TOP_DETAIL, v.q.shape[-1]), dim=-1).indices  # [n, k]
        p_alt, q_alt = v.p[:n].gather(1, columns).tolist(), v.q.gather(1, columns).tolist()
        for row, row_p, row_q in zip(columns.tolist(), p_alt, q_alt, strict=True):
            kept = [(v.token(c), a, b) for c, a, b in zip(row, row_p, row_q, strict=True) if a + b > 0]
            alt_texts.append([texts(t) for t, _, _ in kept])
            alt_p.append([round(a, 6) for _, a, _ in kept])
            alt_q.append([round(b, 6) for _, _, b in kept])
    return alt_texts, alt_p, alt_q


def round_event(
    step: int, name: str, gamma: int, draft: Draft, v: Verification, texts: Callable[[int], str], times: tuple
) -> DraftRound:
    """The DraftRound of one verified draft (plain Python values only)."""
    acc, n = v.acceptance, len(draft.tokens)
    x = [t if v.support is None else v.support.index(t) for t in draft.tokens]  # columns of the draft tokens
    rows, x_index = torch.arange(n), torch.tensor(x, dtype=torch.long)
    alt_texts, alt_p, alt_q = _alternatives(v, n, texts)
    residual_ids, residual_probs = [], []
    if acc.recovered is not None:  # the distribution the recovered token was drawn from
        k = len(acc.accepted)
        residual = (v.p[k] - (v.q[k] if k < n else 0)).clamp_min(0)
        residual = residual / residual.sum() if float(residual.sum()) > 0 else v.p[k]
        residual_ids, residual_probs = _top(residual, TOP_DETAIL, v)
    final = acc.recovered if acc.recovered is not None else acc.bonus
    return DraftRound(
        step=step,
        drafter=name,
        gamma=gamma,
        draft_tokens=list(draft.tokens),
        draft_texts=[texts(t) for t in draft.tokens],
        q=[round(value, 6) for value in v.q[rows, x_index].tolist()],
        p=[round(value, 6) for value in v.p[rows, x_index].tolist()],
        uniforms=[round(u, 6) for u in acc.uniforms],
        accepted=len(acc.accepted),
        recovered=acc.recovered,
        bonus=acc.bonus,
        final_text=texts(final) if final is not None else "",
        residual_top_ids=residual_ids,
        residual_top_texts=[texts(t) for t in residual_ids],
        residual_top_probs=residual_probs,
        alt_texts=alt_texts,
        alt_p=alt_p,
        alt_q=alt_q,
        draft_s=round(times[0], 6),
        verify_s=round(times[1], 6),
    )


def _prefill(loaded: LoadedModel, prompt_ids: list[int]) -> tuple[runtime.DecodeState, int]:
    """Cache every prompt token but the last, which the first verify forward feeds (x_0 of round 0)."""
    if len(prompt_ids) > 1:
        return runtime.prefill(loaded, prompt_ids[:-1])[0], prompt_ids[-1]
    return runtime.new_state(loaded), prompt_ids[0]


def emitted(v: Verification, eos: tuple[int, ...]) -> tuple[list[int], Verification]:
    """The round's tokens (accepted + recovered or bonus); an accepted EOS ends the text, so its bonus is dropped."""
    tokens = v.acceptance.tokens
    if len(tokens) > 1 and tokens[-2] in eos:
        return tokens[:-1], dataclasses.replace(v, acceptance=dataclasses.replace(v.acceptance, bonus=None))
    return tokens, v


def _spans(step: int, start: float, draft_s: float, verify_s: float) -> tuple[PipelineSpan, PipelineSpan]:
    """The round's two serial spans (drafter then target, on one thread) for the pipeline timeline."""
    verify_start = start + draft_s
    return (
        PipelineSpan(step, "drafter", "draft", round(start, 6), round(verify_start, 6)),
        PipelineSpan(step, "target", "verify", round(verify_start, 6), round(verify_start + verify_s, 6)),
    )


@dataclass
class Output:
    """The text side of a run: tokens so far, the streaming detokenizer, token texts, the clock."""

    loaded: LoadedModel
    max_new_tokens: int
    start: float = field(default_factory=time.perf_counter)
    generated: list[int] = field(default_factory=list)
    stop_reason: str | None = None

    def __post_init__(self) -> None:
        self.detokenizer = IncrementalDetokenizer(self.loaded.tokenizer)
        self.text_of = lru_cache(maxsize=8192)(self.loaded.token_text)

    def token_events(self, step: int, tokens: list[int], v: Verification) -> Iterator[TokenEmitted]:
        """One TokenEmitted per token of the round, with the top alternatives of the target's p at its position."""
        n_accepted, eos = len(v.acceptance.accepted), self.loaded.eos_token_ids
        rows = v.processed[: len(tokens)]  # [n, V]; top-k of softmax(rows) without materializing it
        top_logits, top_ids = torch.topk(rows, TOP_ALTERNATIVES, dim=-1)
        top_probs = (top_logits - torch.logsumexp(rows, dim=-1, keepdim=True)).exp()
        for i, token in enumerate(tokens):
            self.generated.append(token)
            source = "accepted" if i < n_accepted else "recovered" if v.acceptance.recovered is not None else "bonus"
            if token in eos:
                self.stop_reason = "eos"
            elif len(self.generated) == self.max_new_tokens:
                self.stop_reason = "max_new_tokens"
            text = self.detokenizer.push(token) + (self.detokenizer.flush() if self.stop_reason else "")
            ids = top_ids[i].tolist()
            alternatives = [self.text_of(t) for t in ids], [round(p, 6) for p in top_probs[i].tolist()]
            yield TokenEmitted(step, token, text, source, time.perf_counter() - self.start, ids, *alternatives)


def decode_loop(
    loaded: LoadedModel,
    prompt_ids: list[int],
    params: SpeculativeParams,
    proposer: Proposer,
    generator: torch.Generator,
) -> Iterator[Event]:
    """Speculative decoding rounds until EOS or the budget, streaming a DraftRound and the round's tokens."""
    out, config, eos = Output(loaded, params.max_new_tokens), params.sampling, loaded.eos_token_ids
    state, last = _prefill(loaded, prompt_ids)
    gamma = min(params.gamma, params.gamma_max) if params.adaptive else params.gamma
    step = 0
    try:
        while out.stop_reason is None:
            remaining = params.max_new_tokens - len(out.generated)
            context = DraftContext(prompt_ids + out.generated, min(gamma, remaining - 1), config, generator, eos)
            t0 = time.perf_counter()
            with section("draft"):
                draft = cut_at_eos(proposer.propose(context), eos)  # 1. draft
            draft_s = time.perf_counter() - t0
            v = verify_draft(state, last, draft, config, context.tokens, generator)  # 2.-3. verify, accept
            proposer.accept(len(v.acceptance.accepted))  # 4. the drafter rolls back (verify_draft crops the target)
            tokens, v = emitted(v, eos)
            yield round_event(step, proposer.name, context.gamma, draft, v, out.text_of, (draft_s, v.verify_s))  # 5.
            yield from _spans(step, t0 - out.start, draft_s, v.verify_s)
            yield from out.token_events(step, tokens, v)
            last = tokens[-1]
            gamma = next_gamma(gamma, len(draft.tokens), len(v.acceptance.accepted), params)  # 6.
            step += 1
        wall = time.perf_counter() - out.start
        yield RunFinished(step, out.stop_reason, wall, len(prompt_ids), state.forwards, proposer.forwards)
    finally:
        state.cache.reset()
        proposer.close()


def run(
    loaded: LoadedModel, prompt_ids: list[int], params: SpeculativeParams, generator: torch.Generator
) -> Iterator[Event]:
    return decode_loop(loaded, prompt_ids, params, proposer_for(loaded, params), generator)


def proposer_for(loaded: LoadedModel, params: SpeculativeParams) -> Proposer:
    """The drafter the params name, with its settings (shared with SSD)."""
    return make_proposer(
        loaded,
        params.drafter,
        draft_model=params.draft_model,
        draft_layers=params.draft_layers,
        max_ngram=params.max_ngram,
        lookup_scaling=params.lookup_scaling,
    )


STRATEGY = Strategy(
    name="speculative",
    family="speculative",
    summary="Draft gamma tokens cheaply, verify them in one target forward, keep what p accepts (lossless).",
    paper="Leviathan et al. 2023, Fast Inference from Transformers via Speculative Decoding (Alg. 1); "
    "Chen et al. 2023, Accelerating LLM Decoding with Speculative Sampling",
    Params=SpeculativeParams,
    run=run,
)
