"""Events of the logit-level family: DoLa's layer contrast, CFG's guidance step, Mirostat's control step."""

from __future__ import annotations

from dataclasses import dataclass

from lab.trace.base import event_kind


@event_kind
@dataclass(frozen=True)
class LayerContrast:
    """One DoLa step (Chuang et al. 2024, Eq. 3-4): the JSD of each candidate premature layer from the final
    layer, the chosen layer M, the emitted token and what plain greedy (argmax of the final layer after the same
    repetition penalty) would have picked, a logit lens (top-1 token of each layer in `lens_layers`, the last
    being the final layer N) and the top-8 of each distribution named in `top_labels` ("final", "premature",
    "contrast", "after penalty": the distribution the token was chosen from, incl. temperature when sampling);
    tokens with p = 0 (outside V_head) are left out, so a list may hold fewer than 8."""

    step: int
    candidate_layers: list[int]
    divergences: list[float]  # JSD(q_N || q_j) per candidate, as the reference reduces it (mean over the vocab)
    chosen_layer: int
    mode: str  # dola | soft
    token_id: int  # the emitted token
    token_text: str
    greedy_token_id: int
    lens_layers: list[int]
    lens_tokens: list[str]
    top_labels: list[str]
    top_ids: list[list[int]]
    top_tokens: list[list[str]]
    top_probs: list[list[float]]


@event_kind
@dataclass(frozen=True)
class GuidanceStep:
    """One classifier-free guidance step (Sanchez et al. 2023, Eq. 7): for the union of the top-8 tokens of the
    conditional, unconditional and guided distributions (sorted by guided probability), their full-vocabulary
    log-softmax values under cond and uncond and the full-vocabulary guided probability softmax(log P_hat).
    A view can re-weight the stored log-probs for another gamma without the model (renormalized over this subset).
    Entropies and KL(guided || cond) are over the full vocabulary, in nats; token_id is the token emitted."""

    step: int
    gamma: float
    token_id: int
    token_ids: list[int]
    tokens: list[str]
    cond_logprobs: list[float]
    uncond_logprobs: list[float]
    guided_probs: list[float]
    entropy_cond: float
    entropy_uncond: float
    entropy_guided: float
    kl_guided_cond: float


@event_kind
@dataclass(frozen=True)
class MirostatStep:
    """One Mirostat step (Basu et al. 2021, Alg. 1): truncation size k (v1's k, v2's number of tokens with
    surprise <= mu), the surprise S fed back, and mu before and after mu <- mu - eta (S - tau).
    `model_surprise` = -log2 p(x) under the model's untruncated distribution at temperature 1 (EOS masked when
    the run ignores EOS), the same measure for every series. Series "mirostat" is the run itself; "top-k" and
    "top-p" are comparison replays (same prompt and seed) with `version` = their setting ("k=40", "p=0.9"),
    mu = mu_next = None and surprise = model_surprise."""

    step: int
    version: str  # v1 | v2 for series "mirostat"; the baseline's setting otherwise
    tau: float  # target surprise in bits
    mu: float | None  # before the update
    mu_next: float | None
    surprise: float  # S fed back to the controller (bits; convention-dependent)
    model_surprise: float  # -log2 p(x), untruncated, T = 1 (bits)
    k: int  # truncation size
    s_hat: float | None  # v1's Zipf exponent estimate
    token_id: int
    series: str = "mirostat"
