"""Mirostat v1 and v2 (the samplers, the decode loop, the baselines; `strategies.mirostat` wires them): sampling
whose truncation is steered by feedback so that the surprise of the sampled
tokens averages to a target tau (Basu et al., ICLR 2021, "Mirostat: A Neural Text Decoding Algorithm that
Directly Controls Perplexity", arXiv:2007.14966). Surprise S(x) = -log2 p(x) in bits; perplexity = 2^tau.

Covered
- v1 (Alg. 1): the Zipf exponent of the m most probable tokens by least squares (`estimate_s_hat`),
  s_hat = sum_i t_i b_i / sum_i t_i^2, t_i = log((i+1)/i), b_i = log(p_i / p_{i+1}), i = 1..m-1; then
  k = ((eps_hat 2^mu) / (1 - N^(-eps_hat)))^(1/s_hat), eps_hat = s_hat - 1, N = vocabulary size (`zipf_k`),
  and a draw from the top k renormalized.
- v2 ("Mirostat 2.0", llama.cpp's `llama_sampler_mirostat_v2`, which cites the same paper): keep the tokens whose
  surprise -log2 p <= mu, at least the most likely one (`v2_truncation_size`), and draw from them renormalized.
- Both: mu_0 = 2 tau; after drawing x, mu <- mu - eta (S(x) - tau) (`update_mu`). Every draw uses the run's
  explicit torch.Generator.
- `compare`: after the run, plain top-k (k = 40) and top-p (p = 0.9) sampling at T = 1 replay the same prompt from
  the same generator state for as many tokens, emitting only MirostatStep events (series "top-k" / "top-p");
  their forwards count in RunFinished.target_forwards. They use lab.engine.sampling (HF semantics: top-k keeps ties at
  the k-th logit, so k can exceed 40 with bf16 logits); v1's own top k is exactly k tokens (torch.topk).

Conventions (`convention`), from the paper's reference code (basusourya/mirostat, mirostat.py, v1 only) and from
llama.cpp (src/llama-sampling.cpp):
- S fed back: "paper" = -log2 p(x) under the untruncated distribution (reference: `log2(1/prob_original[i])`);
  "llama.cpp" = under the truncated, renormalized distribution (`-log2f(cur_p->data[idx].p)` after softmax).
- eta: "paper" 1 (reference `learning_rate = 1`), "llama.cpp" 0.1 (its default `mirostat_eta`); `eta` = 0 picks
  the convention's default, any other value overrides it.
- v1's k: "paper" round(k) + 1 (reference `compute_k(...) + 1`), "llama.cpp" max(floor(k), 1).
- Shared: m = 100, mu_0 = 2 tau, the v2 truncation rule, s_hat over m - 1 pairs (the paper's formula and llama.cpp;
  the reference code's loop `range(100)` uses 100 pairs, i.e. 101 probabilities).
Deliberate differences and assumptions
- N is the model's real vocabulary size (the logits' length, masked tokens included); the reference hard-codes
  n = 50000 for GPT-2. The paper counts words, this (like llama.cpp) counts tokens.
- v2 under "paper": the reference code has no v2, so "paper" there means the paper's feedback conventions
  (S on the untruncated distribution, eta = 1) applied to llama.cpp's v2 truncation. Stated assumption.
- `temperature` (default 1 = none, as in the paper) divides the logits before Mirostat, as llama.cpp's chain
  does (temp, then mirostat; its default temp 0.8 is not copied); "untruncated" then means softmax(z / T).
- `ignore_eos` masks the end-of-sequence logits to -inf before everything (the distribution is then the model's,
  conditioned on not ending) so a run always has max_new_tokens tokens, as the perplexity evaluation needs.
- Numerics: all work is on log-probabilities (float32 log_softmax; s_hat and k in float64), so probabilities that
  underflow never reach log(0). Pairs with a non-finite b_i (-inf logits) are left out of s_hat; with fewer than
  two finite candidates s_hat is None and k = 1. k is computed as log k = (log(eps/(1 - N^-eps)) + mu ln 2) /
  s_hat with eps/(1 - N^-eps) in a stable form: its limit 1/ln N plus the first-order term for |eps ln N| < 1e-6
  (s_hat near 1), expm1/log forms otherwise (also for eps < 0); s_hat <= 0 (a flat top) is taken at its limit
  s_hat -> 0+ (k = N if 2^mu > N - 1, else 1); k is clamped to [1, N] in the log domain, so 2^mu never overflows.
Reported per step (lab.trace.MirostatStep): `surprise` = the S fed back (convention-dependent) and
`model_surprise` = -log2 p(x) under softmax(z) at T = 1 over the whole vocabulary (EOS masked when ignore_eos),
before any truncation: the one measure `python -m lab eval mirostat` reports for every row.
Not covered: batching, repetition penalties, word-level surprise.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

import torch

from lab.engine import runtime
from lab.engine.autoregressive import Hook, Pick, steps
from lab.engine.emitter import TOP_ALTERNATIVES
from lab.engine.models import LoadedModel
from lab.engine.sampling import FILTERED, apply_top_k, apply_top_p, sample
from lab.trace import Event, MirostatStep

LN2 = math.log(2.0)
VERSIONS = ("v1", "v2")
CONVENTIONS = ("paper", "llama.cpp")
DEFAULT_ETA = {"paper": 1.0, "llama.cpp": 0.1}
COMPARE = (("top-k", 40.0), ("top-p", 0.9))  # the `compare` replays: plain top-k and top-p at T = 1
SMALL_X = 1e-6  # |eps ln N| below this: series form of eps / (1 - N^-eps)
S_HAT_MIN = 1e-6  # s_hat <= 0 is evaluated here (its limit)


def update_mu(mu: float, surprise: float, tau: float, eta: float) -> float:
    """Alg. 1, last step: e = S(x) - tau, mu <- mu - eta e."""
    return mu - eta * (surprise - tau)


def estimate_s_hat(sorted_log_probs: torch.Tensor, m: int) -> float | None:
    """Alg. 1: least-squares Zipf exponent of the m most probable tokens (log-probs sorted descending, [>= m]).

    s_hat = sum t_i b_i / sum t_i^2, t_i = log((i+1)/i), b_i = log p_i - log p_{i+1}, i = 1..m-1. Pairs with a
    non-finite b_i (a -inf log-prob) are skipped; None when no pair is left (fewer than two finite candidates)."""
    top = sorted_log_probs[: max(2, m)].double()  # [m]
    b = top[:-1] - top[1:]  # [m-1]
    i = torch.arange(1, top.shape[0], dtype=torch.float64, device=top.device)
    t = torch.log((i + 1) / i)  # [m-1]
    valid = torch.isfinite(b)
    if not bool(valid.any()):
        return None
    return float((t[valid] * b[valid]).sum() / (t[valid] ** 2).sum())


def _log_eps_ratio(eps: float, ln_n: float) -> float:
    """log(eps / (1 - N^-eps)) for any real eps (> 0, < 0 or ~0), N = e^ln_n > 1, without overflow."""
    x = eps * ln_n
    if abs(x) < SMALL_X:  # s_hat ~ 1: eps / (1 - e^-x) = (1 + x/2 + O(x^2)) / ln N
        return -math.log(ln_n) + x / 2
    if x > 0:
        return math.log(eps) - math.log(-math.expm1(-x))
    a = -x  # eps < 0: eps / (1 - e^a) = |eps| / expm1(a), log expm1(a) = a + log(-expm1(-a))
    return math.log(-eps) - (a + math.log(-math.expm1(-a)))


def zipf_log_k(s_hat: float, mu: float, vocab_size: int) -> float:
    """Natural log of Alg. 1's k = ((eps 2^mu) / (1 - N^-eps))^(1/s_hat), eps = s_hat - 1 (unclamped).

    s_hat <= 0 (a flat or rising top, where 1/s_hat is undefined) is taken at its limit s_hat -> 0+ (S_HAT_MIN):
    a huge log k (k = N after clamping) when 2^mu > N - 1, the uniform's surprise, else a hugely negative one."""
    if vocab_size < 2:
        return 0.0
    s = max(s_hat, S_HAT_MIN)
    return (_log_eps_ratio(s - 1.0, math.log(vocab_size)) + mu * LN2) / s


def zipf_k(s_hat: float | None, mu: float, vocab_size: int, convention: str = "paper") -> int:
    """v1's truncation size in [1, N]: round(k) + 1 ("paper", the reference code) or max(floor(k), 1) ("llama.cpp")."""
    if s_hat is None or vocab_size < 2:
        return 1
    log_k = min(zipf_log_k(s_hat, mu, vocab_size), math.log(vocab_size) + 1.0)  # clamp before exp
    k = math.exp(log_k)
    k_int = round(k) + 1 if convention == "paper" else max(int(k), 1)
    return int(min(max(k_int, 1), vocab_size))


def v2_keep_mask(log_probs: torch.Tensor, mu: float) -> torch.Tensor:
    """v2: the tokens with surprise -log2 p <= mu, or the most likely one if none is (llama.cpp's rule); bool [V].

    Surprise grows as p falls, so this set is llama.cpp's kept prefix of the sorted candidates."""
    keep = (-log_probs / LN2) <= mu  # [V]; -inf log-probs give +inf surprise
    if not bool(keep.any()):
        keep = torch.zeros_like(keep).index_fill(-1, log_probs.argmax(-1, keepdim=True), True)
    return keep


def v2_truncation_size(log_probs: torch.Tensor, mu: float) -> int:
    """v2's truncation size: how many tokens have surprise <= mu, at least 1."""
    return int(v2_keep_mask(log_probs, mu).sum())


def mask_tokens(logits: torch.Tensor, token_ids: tuple[int, ...]) -> torch.Tensor:
    """A copy of logits [V] with the given ids set to -inf (never in place)."""
    ids = [i for i in token_ids if 0 <= i < logits.shape[-1]]
    if not ids:
        return logits
    return logits.index_fill(-1, torch.tensor(ids, device=logits.device), FILTERED)


def surprise_bits(log_probs: torch.Tensor, token_id: int) -> float:
    """S = -log2 p(token) from natural log-probabilities [V]."""
    return -float(log_probs[token_id]) / LN2


# --- samplers: one step of truncation, a draw and (Mirostat) the feedback -------------------------------------


@dataclass(frozen=True)
class Choice:
    """What one sampler step decided."""

    token: int
    k: int  # truncation size
    surprise: float  # S fed back (Mirostat) or the model surprise (baselines)
    mu: float | None
    mu_next: float | None
    s_hat: float | None
    top_ids: list[int]  # the most likely tokens of the distribution drawn from
    top_probs: list[float]


@dataclass
class MirostatSampler:
    """Mirostat's state (mu) and one step of Alg. 1 (v1) or of Mirostat 2.0 (v2)."""

    version: str
    tau: float
    eta: float
    m: int = 100
    temperature: float = 1.0
    convention: str = "paper"
    mu: float = field(init=False)

    def __post_init__(self) -> None:
        self.mu = 2.0 * self.tau  # mu_0 = 2 tau

    def truncate(self, log_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float | None]:
        """Log-probs [k] and ids [k] of the tokens kept at the current mu, and v1's s_hat."""
        if self.version == "v1":
            head = torch.topk(log_p, min(self.m, log_p.shape[-1])).values  # [m], descending
            s_hat = estimate_s_hat(head, self.m)
            kept_lp, kept_ids = torch.topk(log_p, zipf_k(s_hat, self.mu, log_p.shape[-1], self.convention))  # [k]
            return kept_lp, kept_ids, s_hat
        kept_ids = v2_keep_mask(log_p, self.mu).nonzero().squeeze(-1)  # [k]
        return log_p[kept_ids], kept_ids, None

    def __call__(self, logits: torch.Tensor, generator: torch.Generator) -> Choice:
        scaled = logits if self.temperature == 1.0 else logits / self.temperature
        log_p = scaled.log_softmax(-1)  # [V] untruncated
        kept_lp, kept_ids, s_hat = self.truncate(log_p)  # 1. truncation at the current mu
        renormalized = kept_lp.log_softmax(-1)  # [k]
        index = sample(renormalized.exp(), generator)  # 2. the draw
        fed_back = kept_lp[index] if self.convention == "paper" else renormalized[index]
        surprise = -float(fed_back) / LN2  # 3. feedback
        mu, self.mu = self.mu, update_mu(self.mu, surprise, self.tau, self.eta)
        top = torch.topk(renormalized, min(TOP_ALTERNATIVES, renormalized.shape[-1]))
        top_ids = kept_ids[top.indices].tolist()
        k = int(kept_ids.shape[-1])
        return Choice(int(kept_ids[index]), k, surprise, mu, self.mu, s_hat, top_ids, top.values.exp().tolist())


@dataclass
class TruncationSampler:
    """Plain top-k ("top-k", value = k) or nucleus ("top-p", value = p) sampling at T = 1 (lab.engine.sampling)."""

    method: str
    value: float

    @property
    def label(self) -> str:
        return f"k={int(self.value)}" if self.method == "top-k" else f"p={self.value:g}"

    def __call__(self, logits: torch.Tensor, generator: torch.Generator) -> Choice:
        kept = apply_top_k(logits, int(self.value)) if self.method == "top-k" else apply_top_p(logits, self.value)
        log_q = kept.log_softmax(-1)  # [V]
        token = sample(log_q.exp(), generator)
        top = torch.topk(log_q, min(TOP_ALTERNATIVES, log_q.shape[-1]))
        k = int(torch.isfinite(kept).sum())
        s = surprise_bits(logits.log_softmax(-1), token)
        return Choice(token, k, s, None, None, None, top.indices.tolist(), top.values.exp().tolist())


Sampler = Callable[[torch.Tensor, torch.Generator], Choice]


# --- the decode loop: lab.engine.autoregressive's, with Mirostat's hook -------------------------------------------


@dataclass(frozen=True)
class LoopSpec:
    """How one loop runs and labels its events."""

    series: str  # mirostat | top-k | top-p
    version: str
    tau: float
    max_new_tokens: int
    ignore_eos: bool
    emit_text: bool  # TokenEmitted events (the run's text) or MirostatStep only (comparisons)


def mirostat_hook(loaded: LoadedModel, sampler: Sampler, spec: LoopSpec, generator: torch.Generator) -> Hook:
    """One step of `lab.engine.autoregressive`'s loop: mask EOS (ignore_eos), truncate, draw and feed back, then the
    step's MirostatStep (after the token's TokenEmitted)."""

    def hook(step: int, output: runtime.ForwardOutput, history: list[int]) -> Pick:
        logits = output.logits[-1]  # 1. [V]
        logits = mask_tokens(logits, loaded.eos_token_ids) if spec.ignore_eos else logits
        choice = sampler(logits, generator)  # 2. truncate, draw, feed back
        model_surprise = surprise_bits(logits.log_softmax(-1), choice.token)  # 3. the common measure
        event = MirostatStep(
            step=step,
            version=spec.version,
            tau=spec.tau,
            mu=choice.mu,
            mu_next=choice.mu_next,
            surprise=model_surprise if spec.series != "mirostat" else choice.surprise,
            model_surprise=model_surprise,
            k=choice.k,
            s_hat=choice.s_hat,
            token_id=choice.token,
            series=spec.series,
        )
        return Pick(choice.token, choice.top_ids, choice.top_probs, after=(event,))

    return hook


def decode_loop(
    loaded: LoadedModel,
    prompt_ids: list[int],
    sampler: Sampler,
    spec: LoopSpec,
    generator: torch.Generator,
    start: float,
) -> Generator[Event, None, tuple[str, int, int]]:
    """Autoregressive decoding with a truncating sampler (`lab.engine.autoregressive.steps` with `mirostat_hook`);
    returns (stop_reason, forwards, new_tokens)."""
    hook = mirostat_hook(loaded, sampler, spec, generator)
    loop = steps(loaded, prompt_ids, hook, spec.max_new_tokens, emit_text=spec.emit_text, start=start)
    outcome = yield from loop
    return outcome.stop_reason, outcome.forwards, outcome.new_tokens


def baseline_steps(
    loaded: LoadedModel,
    prompt_ids: list[int],
    sampler: TruncationSampler,
    spec: LoopSpec,
    generator: torch.Generator,
) -> Iterator[Event]:
    """MirostatStep events of a plain top-k / top-p run (the comparison replays and `lab eval`'s baselines)."""
    yield from decode_loop(loaded, prompt_ids, sampler, spec, generator, time.perf_counter())
