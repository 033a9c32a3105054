"""Classifier-free guidance for text (Sanchez et al. 2023, "Stay on topic with Classifier-Free Guidance").

Each step scores the next token twice, with the prompt (conditional) and without it (unconditional), and steps
from the unconditional towards the conditional log-probabilities by gamma (Sanchez et al. 2023, Eq. 7):

    log P_hat(x | c) = log P(x | uncond) + gamma * (log P(x | c) - log P(x | uncond))

gamma = 1 is plain decoding, gamma > 1 over-emphasizes the prompt, gamma < 1 weakens it (0 = unconditional).
Both log-probs are full-vocabulary log-softmax values, as in transformers' `UnbatchedClassifierFreeGuidanceLogits
Processor` (which returns the conditional scores unchanged at gamma = 1; so does this module). The output
matches `model.generate(guidance_scale=gamma, negative_prompt_ids=...)` greedily token for token (tested, fp32).

Conditional context: the prompt ids as given (with the chat template on: system turn + user turn + assistant
header; SmolLM2's template inserts the default system prompt "You are a helpful AI assistant named SmolLM,
trained by Hugging Face" when none is given). Unconditional context, parameter `unconditional`; in every case
the generated tokens are appended to it, exactly as to the conditional context:
- "last-token" (default, transformers' default when `negative_prompt_ids` is None): the last prompt token
  alone (with the chat template, the newline after "<|im_start|>assistant"), so uncond is "no prompt at all";
- "user-message": the prompt without its system turn (ChatML templates: the ids from the second
  "<|im_start|>" on), i.e. guidance on the system prompt, the assistant setting of Sanchez et al. 2023;
  with SmolLM2 and no explicit system prompt this guides on the *default* system prompt;
- "empty": the tokenizer's BOS token alone (its EOS token when it has none);
- "negative-prompt": `negative_prompt`, wrapped in the chat template when the prompt is (detected by the
  template's fixed suffix; with SmolLM2 the default system prompt is then in both branches and only the user
  message differs), otherwise tokenized as plain text. Guidance pushes away from it (negative prompting).

Both branches run in ONE batched forward per token: a batch of 2 rows in one DynamicCache, the shorter context
left-padded, a 2D attention mask covering past + new positions, and position ids counting real tokens only (so
each row sees the context an unbatched forward would; in fp32 the logits agree with two unbatched forwards to
about 5e-5 on the embedded model and 1e-7 on the tiny one, because masked attention over a padded batch sums in
another order; no greedy token differed in the tests). `RunFinished.target_forwards` counts these batched
forwards (one per token; each processes both rows). After guidance the lab's processors run in HF's order
(CFG is the first processor in `generate`): repetition penalty (on the guided log-probs, with prompt and
generated ids), then temperature, top-k, top-p, min-p; temperature 0 is greedy. Every draw uses the generator.
Not covered: HF's MusicGen-only `ClassifierFreeGuidanceLogitsProcessor` (logit-space mix, caller doubles the
batch), guidance from a different model than the one decoding, per-step gamma schedules.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from lab.engine import runtime
from lab.engine.autoregressive import Forwards, Hook, Pick, decode, top_alternatives
from lab.engine.models import LoadedModel
from lab.engine.runtime import DecodeState
from lab.engine.sampling import SamplingConfig, choose_token, process_logits
from lab.params import DecodeParams, InputError, param
from lab.registry import Strategy
from lab.trace import Event, GuidanceStep

UNCONDITIONAL_CHOICES = ("last-token", "user-message", "empty", "negative-prompt")
EVENT_TOP_K = 8  # the event keeps the union of the top-8 of cond, uncond and guided
MAX_NEGATIVE_PROMPT_CHARS = 4000
CHATML_TURN_START = "<|im_start|>"


@dataclass(frozen=True)
class CFGParams(DecodeParams):
    gamma: float = param(
        1.5, low=0.0, high=10.0, help="log P_hat = log P(x|uncond) + gamma (log P(x|c) - log P(x|uncond)); 1 = off."
    )
    unconditional: str = param(
        "last-token",
        choices=UNCONDITIONAL_CHOICES,
        help="Unconditional context: last prompt token (HF default), prompt without system turn, BOS, or negative.",
    )
    negative_prompt: str = param("", help="Text of the unconditional branch when unconditional = negative-prompt.")
    temperature: float = param(0.0, low=0.0, high=2.0, help="softmax(log P_hat / T) after guidance; 0 = greedy.")
    top_k: int = param(0, low=0, high=1000, help="Keep only the k most likely guided tokens (0 = off).")
    top_p: float = param(1.0, low=0.05, high=1.0, help="Nucleus over the guided distribution (1 = off).")
    min_p: float = param(0.0, low=0.0, high=0.5, help="Drop guided tokens with p < min_p * p_max (0 = off).")
    repetition_penalty: float = param(
        1.0, low=1.0, high=2.0, help="Seen tokens' guided log-probs: z / r if z > 0 else z * r (1 = off)."
    )


def guided_scores(cond_logprobs: torch.Tensor, uncond_logprobs: torch.Tensor, gamma: float) -> torch.Tensor:
    """Sanchez et al. 2023, Eq. 7: log P_hat = log P_u + gamma (log P_c - log P_u), inputs full log-softmax [.., V].

    Written in HF's operation order (gamma * (c - u) + u) so results are bitwise comparable; gamma = 1 returns
    the conditional log-probs unchanged, as HF does. The result is unnormalized: softmax gives P_hat.
    """
    if gamma == 1:
        return cond_logprobs
    return gamma * (cond_logprobs - uncond_logprobs) + uncond_logprobs


# --- the unconditional context ----------------------------------------------------------------------------------


def _chat_suffix(loaded: LoadedModel) -> list[int]:
    """The ids the chat template puts after every user message (end of turn + assistant header)."""
    first, second = loaded.encode("a", chat=True), loaded.encode("b", chat=True)
    n = 0
    while n < min(len(first), len(second)) and first[-1 - n] == second[-1 - n]:
        n += 1
    return first[len(first) - n :] if n else []


def is_chat_prompt(loaded: LoadedModel, prompt_ids: list[int]) -> bool:
    """Whether the prompt was built with the tokenizer's chat template (it ends with the template's suffix)."""
    if not getattr(loaded.tokenizer, "chat_template", None):
        return False
    suffix = _chat_suffix(loaded)
    return bool(suffix) and prompt_ids[-len(suffix) :] == suffix


def _role(loaded: LoadedModel, prompt_ids: list[int]) -> str:
    """The role name of the first ChatML turn (the text after the turn-start token up to the newline)."""
    return loaded.tokenizer.decode(prompt_ids[1:4]).split("\n", 1)[0]


def without_system_turn(loaded: LoadedModel, prompt_ids: list[int]) -> list[int]:
    """A ChatML prompt minus its leading system turn: the ids from the second turn-start token on."""
    convert = getattr(loaded.tokenizer, "convert_tokens_to_ids", None)
    start = convert(CHATML_TURN_START) if convert else None
    chatml = start is not None and loaded.token_text(start) == CHATML_TURN_START
    system_first = chatml and prompt_ids[:1] == [start] and _role(loaded, prompt_ids) == "system"
    if not system_first or start not in prompt_ids[1:]:
        raise InputError(
            "unconditional = user-message needs a ChatML prompt that starts with a system turn "
            "(turn the chat template on), or choose another unconditional context."
        )
    return prompt_ids[prompt_ids.index(start, 1) :]


def unconditional_ids(loaded: LoadedModel, prompt_ids: list[int], params: CFGParams) -> list[int]:
    """The unconditional branch's context for `params.unconditional` (see the module docstring)."""
    choice = params.unconditional
    if len(params.negative_prompt) > MAX_NEGATIVE_PROMPT_CHARS:
        raise InputError(f"The negative prompt is longer than {MAX_NEGATIVE_PROMPT_CHARS} characters.")
    if choice == "last-token":
        return prompt_ids[-1:]
    if choice == "user-message":
        return without_system_turn(loaded, prompt_ids)
    if choice == "empty":
        bos = getattr(loaded.tokenizer, "bos_token_id", None)
        return [bos if bos is not None else loaded.eos_token_ids[0]]
    if choice == "negative-prompt":
        ids = loaded.encode(params.negative_prompt, chat=is_chat_prompt(loaded, prompt_ids))
        if not ids:
            raise InputError("unconditional = negative-prompt needs a non-empty negative_prompt.")
        return ids
    raise InputError(f"unconditional must be one of {', '.join(UNCONDITIONAL_CHOICES)}, got {choice!r}.")


# --- the batched two-row forward -------------------------------------------------------------------------------


@dataclass
class Branches:
    """The cond (row 0) and uncond (row 1) contexts in one batch-2 cache, with their padding mask and positions."""

    state: DecodeState
    mask: torch.Tensor  # [2, T_past] 1 = real token, 0 = left padding
    next_positions: torch.Tensor  # [2, 1] position id of each row's next token

    @property
    def forwards(self) -> int:
        return self.state.forwards

    @property
    def cache(self) -> DynamicCache:
        return self.state.cache


def _forward(branches: Branches, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """One batched forward of [2, T] new ids after the cached past; returns float32 last-position logits [2, V]."""
    # the mask is [2, T_past + T], already extended by the caller
    return runtime.forward_rows(branches.state, input_ids, branches.mask, position_ids)


def prefill_branches(loaded: LoadedModel, cond_ids: list[int], uncond_ids: list[int]) -> tuple[Branches, torch.Tensor]:
    """Encode both contexts in one forward, the shorter one left-padded; returns the branches and logits [2, V]."""
    if not cond_ids or not uncond_ids:
        raise ValueError("both branches need at least one token")
    device, width = loaded.device, max(len(cond_ids), len(uncond_ids))
    pad = getattr(loaded.tokenizer, "pad_token_id", None)
    pad = pad if pad is not None else loaded.eos_token_ids[0]
    rows = [[pad] * (width - len(ids)) + list(ids) for ids in (cond_ids, uncond_ids)]
    input_ids = torch.tensor(rows, dtype=torch.long, device=device)  # [2, T]
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in (cond_ids, uncond_ids)], device=device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)  # [2, T] padding gets 0 (masked out anyway)
    branches = Branches(DecodeState(loaded, DynamicCache(config=loaded.config)), mask, positions[:, -1:] + 1)
    logits = _forward(branches, input_ids, positions)
    branches.state.tokens.extend(cond_ids)
    return branches, logits


def step_branches(branches: Branches, token_id: int) -> torch.Tensor:
    """Append the same emitted token to both rows in one forward; returns next-token logits [2, V]."""
    device = branches.mask.device
    input_ids = torch.tensor([[token_id], [token_id]], dtype=torch.long, device=device)  # [2, 1]
    branches.mask = torch.cat([branches.mask, torch.ones_like(branches.mask[:, :1])], dim=-1)  # [2, T_past + 1]
    positions = branches.next_positions
    branches.next_positions = positions + 1
    logits = _forward(branches, input_ids, positions)
    branches.state.tokens.append(token_id)
    return logits


# --- the trace event ---------------------------------------------------------------------------------------------


def _entropy(logprobs: torch.Tensor) -> float:
    """H(p) = -sum p log p in nats, p = exp(logprobs) [V]."""
    return float(-(logprobs.exp() * logprobs).sum())


def guidance_event(step: int, gamma: float, token_id: int, logprobs: torch.Tensor, loaded: LoadedModel) -> GuidanceStep:
    """The GuidanceStep of one step from the stacked full-vocabulary log-probs [3, V]: cond, uncond, guided."""
    cond, uncond, guided = logprobs  # each [V], normalized log-softmax values
    tops = torch.topk(logprobs, EVENT_TOP_K, dim=-1).indices.flatten().tolist()  # [3 * k]
    ids = sorted(set(tops), key=lambda i: -float(guided[i]))
    index = torch.tensor(ids, device=logprobs.device)
    probs_guided = guided.exp()  # [V]
    return GuidanceStep(
        step=step,
        gamma=float(gamma),
        token_id=token_id,
        token_ids=ids,
        tokens=[loaded.token_text(i) for i in ids],
        cond_logprobs=cond[index].tolist(),
        uncond_logprobs=uncond[index].tolist(),
        guided_probs=probs_guided[index].tolist(),
        entropy_cond=_entropy(cond),
        entropy_uncond=_entropy(uncond),
        entropy_guided=_entropy(guided),
        kl_guided_cond=max(0.0, float((probs_guided * (guided - cond)).sum())),
    )


# --- the decode loop ---------------------------------------------------------------------------------------------


def cfg_hook(loaded: LoadedModel, params: CFGParams, generator: torch.Generator) -> Hook:
    """One step of `lab.engine.autoregressive`'s loop from both branches' logits [2, V]: guidance, the lab's
    processors, the choice, then the GuidanceStep event (before the token's TokenEmitted)."""
    config = SamplingConfig(params.temperature, params.top_k, params.top_p, params.min_p, params.repetition_penalty)

    def hook(step: int, logits: torch.Tensor, history: list[int]) -> Pick:
        cond, uncond = torch.log_softmax(logits, dim=-1)  # 1. full log-softmax per branch, [V] each
        scores = guided_scores(cond, uncond, params.gamma)  # 2. Eq. 7, [V]
        processed = process_logits(scores, config, history)  # 3. HF order after CFG
        token = choose_token(processed, config, generator)  # 4. argmax or seeded draw
        guided = torch.log_softmax(scores, dim=-1)  # [V] log P_hat, normalized
        event = guidance_event(step, params.gamma, token, torch.stack([cond, uncond, guided]), loaded)  # 5.
        return Pick(token, *top_alternatives(processed), before=(event,))

    return hook


def decode_loop(
    loaded: LoadedModel, prompt_ids: list[int], uncond_ids: list[int], params: CFGParams, generator: torch.Generator
) -> Iterator[Event]:
    """CFG decoding: one batched (cond, uncond) forward per token, streaming GuidanceStep + TokenEmitted."""

    def prefill(loaded: LoadedModel, cond_ids: list[int]) -> tuple[Branches, torch.Tensor]:
        return prefill_branches(loaded, cond_ids, uncond_ids)

    forwards = Forwards(prefill, step_branches)  # both rows advance in one forward, [2, V]
    return decode(loaded, prompt_ids, cfg_hook(loaded, params, generator), params.max_new_tokens, forwards=forwards)


def run(loaded: LoadedModel, prompt_ids: list[int], params: CFGParams, generator: torch.Generator) -> Iterator[Event]:
    """Builds the unconditional context eagerly (a bad choice raises InputError here), then streams."""
    return decode_loop(loaded, prompt_ids, unconditional_ids(loaded, prompt_ids, params), params, generator)


STRATEGY = Strategy(
    name="cfg",
    family="logit-level",
    summary="Classifier-free guidance: log P_hat = log P_u + gamma (log P_c - log P_u), both branches batched.",
    paper="Sanchez et al. 2023, Stay on topic with Classifier-Free Guidance (arXiv:2306.17806), Eq. 7",
    Params=CFGParams,
    run=run,
)
