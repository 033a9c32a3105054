"""DoLa: decoding by contrasting the final layer with a dynamically chosen premature layer (Chuang et al. 2024).

Covered: the candidate premature layers exactly as transformers 4.52 picks them for `generate(dola_layers=...)`
(`candidate_layers`: buckets 'low' / 'high' or an explicit list), early-exit logits q_j = softmax(lm_head(h_j))
(Eq. 1), the premature layer M = argmax_j JSD(q_N || q_j) over the candidates (Eq. 3, `js_divergences`, reduced
as the reference does: KL terms averaged over the vocabulary), the contrast log q_N - log q_M restricted to
V_head = {x : q_N(x) >= alpha * max_w q_N(w)} (Eq. 4, `plausibility_contrast`), then the repetition penalty
(Sec. 2.4, theta = 1.2 by default) and greedy argmax or sampling (temperature / top-k / top-p via `lab.engine.sampling`,
every draw from the explicit generator). A second, non-paper mode "soft contrast" (`soft_contrast`) scores
log q_N + a * max(0, log q_N - log q_M): it only boosts tokens the final layer likes more than layer M and
never removes a token, so the base distribution's grammar stays intact (no V_head needed).
Each step emits a `LayerContrast` event (candidates, divergences, chosen layer, the plain greedy choice, a logit
lens: top-1 of the candidate layers and the final layer, of every layer 1..N with `lens_all_layers` (about +12%
time per token, so off by default), and the top-8 of final / premature / contrast / after-penalty) and a
`TokenEmitted`. The forward skips the model's own LM head (see the first difference below).

Matches transformers 4.52.4's `_dola_decoding` / `_dola_select_contrast` token for token in greedy fp32 on the
embedded model (tests/test_dola.py against tests/data/dola_golden.json from scripts/make_dola_golden.py):
the final logits are lm_head(h_N) (hidden_states[N] is already through the final norm), the premature logits
are lm_head(h_j) WITHOUT the final norm, the repetition penalty acts on the contrast logits, EOS ends the run
(the EOS token is emitted).
Deliberate differences from the reference:
- the forward runs the decoder without its LM head (`lab.engine.runtime.forward_hidden`), and the final logits
  and every early exit come from ONE batched lm_head matmul over the stacked hidden states [1 + R, H] (the
  reference calls lm_head once for the final layer and once per candidate): the head's weights are read once
  per token. The results agree to float rounding (the golden test holds);
- early-exit logits are upcast to float32 before the softmaxes (the reference keeps the model dtype for them;
  identical in fp32);
- `apply_final_norm=True` (off by default) exits through the final norm, lm_head(norm(h_j)), as a logit lens
  usually does; the reference never applies it;
- the divergence is the reference's, not the paper's JSD formula (see `js_divergences`); it is also computed
  (and shown) when there is a single candidate, where the reference skips it (M is the same either way);
- explicit layer lists are de-duplicated and negative indices rejected (the reference would index from the
  end); layers >= N are dropped as in the reference;
- the soft mode is this lab's addition, not in the paper or the reference.
Not covered: static premature layers (the paper's DoLa-static), batching several prompts, encoder-decoders.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lab.engine import runtime
from lab.engine.autoregressive import Forwards, Hook, Pick, decode
from lab.engine.models import LoadedModel
from lab.engine.sampling import SamplingConfig, apply_repetition_penalty, choose_token, process_logits
from lab.params import POSITIVE, DecodeParams, InputError, param
from lab.registry import Strategy
from lab.trace import Event, LayerContrast

TOP_K = 8
TOP_LABELS = ["final", "premature", "contrast", "after penalty"]
MIN_MEAN = 1e-30  # clamp of M inside the divergence's log (see `js_divergences`)
BASE_FILTER_VALUE = -1e-3  # the reference's log q_M outside V_head (the contrast there is -inf anyway)


@dataclass(frozen=True)
class DolaParams(DecodeParams):
    mode: str = param(
        "dola",
        choices=("dola", "soft"),
        help="dola: log q_N - log q_M on V_head (paper, Eq. 4). soft (lab variant, not the paper): "
        "log q_N + soft_alpha * max(0, log q_N - log q_M), no token removed.",
    )
    dola_layers: str = param(
        "high",
        help="Candidate premature layers: 'high' (upper half), 'low' (lower half) or indices like '0,2,4,6,8' "
        "(0 = embeddings; layers >= N dropped). M = argmax JSD(q_N || q_j) over them (Eq. 3).",
    )
    relative_top: float = param(
        0.1, low=0.001, high=1.0, help="alpha of V_head = {x : q_N(x) >= alpha * max q_N} (dola mode, Eq. 4)."
    )
    soft_alpha: float = param(
        1.0,
        low=0.0,
        high=10.0,
        help="Soft contrast only: a in log q_N + a * max(0, log q_N - log q_M).",
        only_when=("mode", "soft"),
    )
    repetition_penalty: float = param(
        1.2, low=1.0, high=2.0, help="Seen tokens: z / r if z > 0 else z * r on the contrast (Sec. 2.4; 1 = off)."
    )
    temperature: float = param(
        0.0, low=0.0, high=2.0, help="0 = greedy argmax of the contrast; > 0 samples softmax(contrast / T)."
    )
    top_k: int = param(
        0,
        low=0,
        high=1000,
        help="Sampling only: keep the k best contrast scores (0 = off).",
        only_when=("temperature", POSITIVE),
    )
    top_p: float = param(
        1.0,
        low=0.05,
        high=1.0,
        help="Sampling only: nucleus over softmax(contrast) (1 = off).",
        only_when=("temperature", POSITIVE),
    )
    apply_final_norm: bool = param(
        False, help="Early exit through the final norm, lm_head(norm(h_j)); off = lm_head(h_j) as the reference."
    )
    lens_all_layers: bool = param(
        False,
        help="Logit lens of every layer 1..N in the trace (extra rows in the same matmul, about +12% time per "
        "token on the embedded model); off = the candidate layers and the final layer only.",
    )


def start_layer(num_layers: int, tied_embeddings: bool) -> int:
    """First usable layer: with tied embeddings lm_head(h_0) is near identity, so skip to 2 (1 if N = 2)."""
    if not tied_embeddings:
        return 0
    return 2 if num_layers > 2 else (1 if num_layers == 2 else 0)


def candidate_layers(spec: str, num_layers: int, tied_embeddings: bool) -> list[int]:
    """Candidate premature layers J as transformers 4.52 `_dola_decoding` picks them.

    'low': range(start, N // 2, 2) (range(start, 20, 2) when N > 40; [start] when start == N // 2);
    'high': range(N // 2, N, 2) (range(N - 20, N, 2) when N > 40); otherwise comma-separated indices,
    0 = the embeddings, layers >= N dropped as in the reference.
    """
    spec = spec.strip().lower()
    n = num_layers
    if spec in ("low", "high"):
        first = start_layer(n, tied_embeddings)
        if spec == "high":
            layers = list(range(n // 2, n, 2)) if n <= 40 else list(range(n - 20, n, 2))
        elif first == n // 2:
            layers = [first]
        else:
            layers = list(range(first, n // 2, 2)) if n <= 40 else list(range(first, 20, 2))
        if not layers:  # e.g. 'low' on a 3-layer tied model: the reference would fail on an empty stack
            raise InputError(f"dola_layers {spec!r} selects no layer of this {n}-layer model; list layers instead.")
        return layers
    try:
        layers = [int(part) for part in spec.replace(" ", "").split(",") if part]
    except ValueError:
        raise InputError(f"dola_layers must be 'low', 'high' or layer indices like '0,2,4', got {spec!r}.") from None
    if any(layer < 0 for layer in layers):
        raise InputError(f"dola_layers indices must be >= 0 (0 = embeddings), got {spec!r}.")
    kept = list(dict.fromkeys(layer for layer in layers if layer < n))
    if not kept:
        raise InputError(f"dola_layers {spec!r} has no layer below N = {n}; use 'low', 'high' or 0..{n - 1}.")
    return kept


def js_divergences(final_logits: torch.Tensor, premature_logits: torch.Tensor) -> torch.Tensor:
    """The divergence d(q_N, q_j) per candidate that picks M (Eq. 3), as the reference computes it: with
    M = (q_N + q_j) / 2, 0.5 * (KL(M || q_N) + KL(M || q_j)) with each KL AVERAGED over the vocabulary
    (`F.kl_div(log q, M, reduction="none").mean(-1)`). Note: the paper's JSD is 0.5 * (KL(q_N || M) +
    KL(q_j || M)); the reference uses the KL(M || .) direction and a mean instead of a sum; we follow it.
    Symmetric in (q_N, q_j), zero iff they are equal. final_logits [V], premature_logits [C, V] -> [C].

    Computed in one pass as mean_x M (log M - (log q_N + log q_j) / 2) (algebraically the reference's sum of two
    `kl_div`s), with M clamped at 1e-30 inside the log: M log M of such tokens is < 1e-28, and log() on the
    zeros and denormals of very peaked early exits is slow on CPUs. Agrees with the reference to ~1e-7."""
    mean = 0.5 * (F.softmax(final_logits, dim=-1)[None, :] + F.softmax(premature_logits, dim=-1))  # [C, V]
    log_sum = F.log_softmax(final_logits, dim=-1)[None, :] + F.log_softmax(premature_logits, dim=-1)  # [C, V]
    return (mean * (mean.clamp_min(MIN_MEAN).log() - 0.5 * log_sum)).mean(-1)  # [C]


def plausibility_contrast(final_logits: torch.Tensor, premature_logits: torch.Tensor, alpha: float) -> torch.Tensor:
    """F(q_N, q_M) (Eq. 4): log q_N - log q_M on V_head = {x : q_N(x) >= alpha * max q_N}, -inf elsewhere
    (the reference's `_relative_top_filter` with min_tokens_to_keep = 1). [V] -> [V]."""
    log_final = F.log_softmax(final_logits, dim=-1)  # [V]
    log_premature = F.log_softmax(premature_logits, dim=-1)  # [V]
    outside = log_final < log_final.max() + math.log(alpha)  # [V]
    log_final = log_final.masked_fill(outside, float("-inf"))
    log_premature = log_premature.masked_fill(outside, BASE_FILTER_VALUE)
    return log_final - log_premature


def soft_contrast(final_logits: torch.Tensor, premature_logits: torch.Tensor, a: float) -> torch.Tensor:
    """Soft contrast (lab variant): log q_N + a * max(0, log q_N - log q_M); only positive differences count."""
    log_final = F.log_softmax(final_logits, dim=-1)  # [V]
    log_premature = F.log_softmax(premature_logits, dim=-1)  # [V]
    return log_final + a * (log_final - log_premature).clamp_min(0.0)


@dataclass(frozen=True)
class Contrast:
    """One step's layer contrast: what was compared, what was chosen and the resulting scores."""

    num_layers: int  # N
    candidates: list[int]  # J
    layers: list[int]  # rows of `exits` (J, plus every layer 1..N-1 for the lens)
    exits: torch.Tensor  # [R, V] early-exit logits of `layers`
    final: torch.Tensor  # [V] the model's final logits (layer N)
    divergences: torch.Tensor  # [C] JSD(q_N || q_j) per candidate
    chosen: int  # premature layer M
    scores: torch.Tensor  # [V] contrast logits (before the repetition penalty)

    def exit_of(self, layer: int) -> torch.Tensor:
        return self.exits[self.layers.index(layer)]


def _prefill_hidden(loaded: LoadedModel, prompt_ids: list[int]) -> tuple[runtime.DecodeState, tuple[torch.Tensor, ...]]:
    state = runtime.new_state(loaded)
    return state, runtime.forward_hidden(state, prompt_ids)


def _step_hidden(state: runtime.DecodeState, token: int) -> tuple[torch.Tensor, ...]:
    return runtime.forward_hidden(state, [token])


# the forward skips the LM head: each step's output is every layer's hidden state at the last position, (N + 1) x [H]
HIDDEN = Forwards(_prefill_hidden, _step_hidden)


@torch.inference_mode()
def contrast_step(
    loaded: LoadedModel, hidden: tuple[torch.Tensor, ...], candidates: list[int], params: DolaParams
) -> Contrast:
    """Final and early-exit logits in ONE lm_head matmul, the divergence per candidate, M (Eq. 3), the contrast."""
    n = loaded.num_layers
    layers = sorted(set(candidates).union(range(1, n) if params.lens_all_layers else ()))
    early = torch.stack([hidden[layer] for layer in layers])  # [R, H]
    if params.apply_final_norm:
        early = loaded.final_norm(early)
    logits = loaded.lm_head(torch.cat([hidden[n][None, :], early])).float()  # [1 + R, V]
    final, exits = logits[0], logits[1:]  # [V], [R, V]
    rows = [layers.index(layer) for layer in candidates]
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    premature = exits[rows[0] : rows[0] + len(rows)] if contiguous else exits[rows]  # [C, V] (a view if it can)
    divergences = js_divergences(final, premature)  # [C]
    chosen = candidates[int(divergences.argmax())]  # first maximum, as torch.argmax in the reference
    base = premature[candidates.index(chosen)]  # [V]
    if params.mode == "soft":
        scores = soft_contrast(final, base, params.soft_alpha)
    else:
        scores = plausibility_contrast(final, base, params.relative_top)
    return Contrast(n, candidates, layers, exits, final, divergences, chosen, scores)


class TokenTexts(dict):
    """Token id -> text, decoded once per run (the lens needs about N texts per step)."""

    def __init__(self, loaded: LoadedModel) -> None:
        super().__init__()
        self.loaded = loaded

    def __missing__(self, token_id: int) -> str:
        self[token_id] = text = self.loaded.token_text(token_id)
        return text


def top_of(logits: torch.Tensor, texts: TokenTexts) -> tuple[list[int], list[str], list[float]]:
    """Top-8 ids, texts and probabilities of softmax(logits); tokens with p = 0 (outside V_head) are left out."""
    values, ids = torch.topk(logits.softmax(dim=-1), TOP_K)
    kept = [(i, v) for i, v in zip(ids.tolist(), values.tolist(), strict=True) if v > 0]
    return [i for i, _ in kept], [texts[i] for i, _ in kept], [round(v, 6) for _, v in kept]


def layer_contrast_event(
    step: int, contrast: Contrast, processed: torch.Tensor, token: int, greedy: int, mode: str, texts: TokenTexts
) -> LayerContrast:
    """The step's detail event: plain Python values, top-8 per distribution, one lens token per layer >= 1."""
    lens_layers = [layer for layer in contrast.layers if layer > 0]
    lens_ids = contrast.exits[[contrast.layers.index(layer) for layer in lens_layers]].argmax(-1).tolist()
    lens_ids.append(int(contrast.final.argmax()))
    distributions = (contrast.final, contrast.exit_of(contrast.chosen), contrast.scores, processed)
    tops = [top_of(logits, texts) for logits in distributions]
    return LayerContrast(
        step=step,
        candidate_layers=list(contrast.candidates),
        divergences=[float(d) for d in contrast.divergences.tolist()],
        chosen_layer=contrast.chosen,
        mode=mode,
        token_id=token,
        token_text=texts[token],
        greedy_token_id=greedy,
        lens_layers=lens_layers + [contrast.num_layers],
        lens_tokens=[texts[i] for i in lens_ids],
        top_labels=list(TOP_LABELS),
        top_ids=[top[0] for top in tops],
        top_tokens=[top[1] for top in tops],
        top_probs=[top[2] for top in tops],
    )


def sampling_config(params: DolaParams) -> SamplingConfig:
    return SamplingConfig(params.temperature, params.top_k, params.top_p, 0.0, params.repetition_penalty)


def dola_hook(loaded: LoadedModel, candidates: list[int], params: DolaParams, generator: torch.Generator) -> Hook:
    """One step of `lab.engine.autoregressive`'s loop from the step's hidden states: the LayerContrast event, then
    the token with the top-8 it was chosen from."""
    config, texts = sampling_config(params), TokenTexts(loaded)

    def hook(step: int, hidden: tuple[torch.Tensor, ...], history: list[int]) -> Pick:
        contrast = contrast_step(loaded, hidden, candidates, params)  # 1. early exits, JSD, M, contrast [V]
        processed = process_logits(contrast.scores, config, history)  # 2. repetition penalty (+ warpers)
        token = choose_token(processed, config, generator)  # 3. argmax or a seeded draw
        greedy = int(apply_repetition_penalty(contrast.final, history, params.repetition_penalty).argmax())
        event = layer_contrast_event(step, contrast, processed, token, greedy, params.mode, texts)
        return Pick(token, list(event.top_ids[-1]), list(event.top_probs[-1]), before=(event,))  # 4.

    return hook


def decode_loop(
    loaded: LoadedModel, prompt_ids: list[int], params: DolaParams, generator: torch.Generator
) -> Iterator[Event]:
    """DoLa decoding, one target forward (hidden states, no LM head) per token, streaming LayerContrast +
    TokenEmitted; EOS ends the run (emitted, as in the reference)."""
    candidates = candidate_layers(params.dola_layers, loaded.num_layers, tied_embeddings(loaded))
    hook = dola_hook(loaded, candidates, params, generator)
    return decode(loaded, prompt_ids, hook, params.max_new_tokens, forwards=HIDDEN)


def tied_embeddings(loaded: LoadedModel) -> bool:
    config = loaded.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text_config, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))


def run(loaded: LoadedModel, prompt_ids: list[int], params: DolaParams, generator: torch.Generator) -> Iterator[Event]:
    candidate_layers(params.dola_layers, loaded.num_layers, tied_embeddings(loaded))  # validate before streaming
    return decode_loop(loaded, prompt_ids, params, generator)


STRATEGY = Strategy(
    name="dola",
    family="logit-level",
    summary="Contrast the final layer with the most divergent early layer: log q_N - log q_M on plausible tokens.",
    paper="Chuang et al. 2024, DoLa: Decoding by Contrasting Layers Improves Factuality in LLMs (ICLR 2024)",
    Params=DolaParams,
    run=run,
)
