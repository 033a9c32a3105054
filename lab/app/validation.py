"""Input validation in one place, used by the CLI, the app and the benchmark (issue: bad input never crashes).

Everything a user types passes through `validate_request` before any model work: the prompt (empty, or over the
character limit, rejected before tokenizing), the strategy name, every parameter (type, range, choices), the seed,
the model name, device, dtype and weight precision. After tokenizing, `check_prompt_fits` rejects prompts that leave
no room for generation in the model's context window. Each failure is an `InputError` with a message to show.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lab.engine.models import DEVICES, DTYPES, LoadedModel, validate_model_spec
from lab.engine.quant import PRECISIONS
from lab.params import InputError, build_params
from lab.registry import get_strategy

MAX_PROMPT_CHARS = 12_000
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class RunRequest:
    """A validated request: what to run, on what, with which settings."""

    strategy: Any  # lab.registry.Strategy
    params: Any  # an instance of strategy.Params
    prompt: str
    chat: bool
    seed: int
    model: str
    device: str
    dtype: str
    precision: str = "auto"  # weight format of the model's linears (lab.engine.quant.PRECISIONS)


CONTINUE = "something for the model to continue"  # what a prompt holds unless the strategy says otherwise


def validate_prompt(prompt: Any, needs: str = CONTINUE) -> str:
    """The prompt as given, or InputError: not text, over the limit, or empty (the message says what it `needs`)."""
    if not isinstance(prompt, str):
        raise InputError("The prompt must be text.")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise InputError(f"The prompt has {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}.")
    if not prompt.strip():
        raise InputError(f"The prompt is empty; type {needs}.")
    return prompt


def validate_seed(seed: Any) -> int:
    try:
        if isinstance(seed, float) and not seed.is_integer():
            raise ValueError(seed)
        value = int(seed)
    except (TypeError, ValueError, OverflowError):
        raise InputError(f"The seed must be an integer, got {seed!r}.") from None
    if not 0 <= value <= MAX_SEED:
        raise InputError(f"The seed must be between 0 and {MAX_SEED}.")
    return value


def validate_request(
    strategy: str,
    prompt: Any,
    params: dict[str, Any] | None = None,
    *,
    chat: bool = True,
    seed: Any = 0,
    model: Any = "smollm2-135m",
    device: str = "auto",
    dtype: str = "auto",
    precision: str = "auto",
) -> RunRequest:
    """Check everything a user supplied; raise InputError with a clear message on the first problem."""
    found = get_strategy(strategy)
    built = build_params(found.Params, dict(params or {}))
    if device not in DEVICES:
        raise InputError(f"Unknown device {device!r}; choose one of {', '.join(DEVICES)}.")
    if dtype != "auto" and dtype not in DTYPES:
        raise InputError(f"Unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}.")
    if precision not in PRECISIONS:
        raise InputError(f"Unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}.")
    return RunRequest(
        found,
        built,
        validate_prompt(prompt, found.prompt_hint(built) if found.prompt_hint else CONTINUE),
        bool(chat),
        validate_seed(seed),
        validate_model_spec(model),
        device,
        dtype,
        precision,
    )


def check_prompt_fits(loaded: LoadedModel, prompt_ids: list[int], max_new_tokens: int) -> None:
    """Reject a prompt that, with the generation budget, does not fit the model's context window."""
    context = int(getattr(loaded.config, "max_position_embeddings", 0) or 0)
    if context and len(prompt_ids) + max_new_tokens > context:
        raise InputError(
            f"The prompt is {len(prompt_ids)} tokens; with max_new_tokens={max_new_tokens} it exceeds the "
            f"model's context of {context} tokens. Shorten the prompt or lower max_new_tokens."
        )
