"""Recursive Language Models (Zhang, Kraska, Khattab 2025): answer a question about a context far longer than
the model's window by letting the model inspect the context through a sandboxed Python REPL.

The prompt is the question. The context is a generated task (`task`: needle / count / sum over synthetic logs
of `context_tokens` tokens from `task_seed`, `lab.methods.rlm.tasks`, with a known answer; tally is the family whose
answer needs a sub-call on every chunk) or the text pasted in
`context_text` (`task` = pasted). The prompt is never replaced silently: asking the generated task's own question
is an explicit choice, either by putting it in the prompt (the Run tab's "Ask the task's question" button,
`task_question`) or with `use_task_question` on (the CLI's way; the prompt is then ignored). When the question asked
is the task's own, its known answer is the expected one and the run's answer is checked against it.
The context lives only in the worker (`lab.methods.rlm.sandbox`); the root sees its length and a prefix.
`mode` = action (default; the model picks each step from a constrained grammar, `lab.methods.rlm.actions`) or
code (the paper's free-form ```repl code; refused unless the sandbox is fully isolated, see
`lab.methods.rlm.sandbox`). The loop itself is `lab.methods.rlm.loop`.
Emits: RlmContext, one ReplCall per root turn and sub-call, RlmResult, the answer's tokens as TokenEmitted
(source "target"), RunFinished (stop_reason eos after FINAL, max_new_tokens after a limit).
`max_new_tokens` bounds each root turn's generation in code mode and the length of the emitted answer.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lab.engine.models import LoadedModel
from lab.engine.text import IncrementalDetokenizer
from lab.methods.rlm import tasks
from lab.methods.rlm.loop import RlmConfig, RlmRun, answer_matches
from lab.methods.rlm.sandbox import Sandbox, SandboxLimits, code_mode_refusal, probe_isolation
from lab.params import DecodeParams, InputError, param
from lab.registry import Strategy
from lab.trace import Event, RlmContext, RlmResult, RunFinished, TokenEmitted

MAX_CONTEXT_CHARS = 4_000_000
USER_TURN = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S)


@dataclass(frozen=True)
class RlmParams(DecodeParams):
    mode: str = param("action", choices=("action", "code"), help="action: constrained grammar; code: free ```repl.")
    task: str = param(
        "needle", choices=(*tasks.ALL_KINDS, "pasted"), help="Context generator (tally needs every chunk), or pasted."
    )
    context_tokens: int = param(20_000, low=1_000, high=500_000, help="Size of the generated document in tokens.")
    task_seed: int = param(0, low=0, high=1_000_000, help="Seed of the generated document and question.")
    use_task_question: bool = param(
        False, help="Ask the generated task's own question and ignore the prompt (its answer is known and checked)."
    )
    context_text: str = param("", help="The context when task = pasted (any length up to 4M characters).")
    max_iterations: int = param(6, low=1, high=20, help="Root turns before the root must answer.")
    max_depth: int = param(2, low=1, high=3, help="Deepest llm_query level (1 = plain sub-calls, as in the paper).")
    max_sub_calls: int = param(64, low=0, high=512, help="llm_query calls allowed in the run.")
    max_total_tokens: int = param(100_000, low=1_000, high=2_000_000, help="Prompt + generated tokens, all calls.")
    sub_window: int = param(1024, low=128, high=8192, help="Tokens of text one sub-call sees (longer: split/cut).")
    output_chars: int = param(800, low=100, high=8000, help="REPL output characters shown back to the root.")
    cell_timeout_s: float = param(10.0, low=1.0, high=60.0, help="Wall-clock limit of one REPL cell (kills it).")


def question_text(loaded: LoadedModel, prompt_ids: list[int]) -> str:
    """The user's question: the last user turn of the chat-templated prompt, or the whole prompt if raw."""
    text = loaded.tokenizer.decode(prompt_ids, skip_special_tokens=False)
    turns = USER_TURN.findall(text)
    return (turns[-1] if turns else loaded.decode(prompt_ids)).strip()


def build_context(params: RlmParams, prompt_question: str) -> tuple[str, str, str]:
    """(context, question, expected answer or "") for the run's settings."""
    if params.task == "pasted":
        if not params.context_text.strip():
            raise InputError("task = pasted needs the context in context_text.")
        if len(params.context_text) > MAX_CONTEXT_CHARS:
            raise InputError(f"context_text has {len(params.context_text)} characters; the limit is 4,000,000.")
        return params.context_text, prompt_question, ""
    task = tasks.make_task(params.task, params.context_tokens, params.task_seed)
    question = task.question if params.use_task_question else prompt_question
    return task.context, question, task.answer if same_question(question, task.question) else ""


def same_question(asked: str, own: str) -> bool:
    """Whether the question asked is the task's own (case, spacing and a final "?" aside)."""

    def norm(text: str) -> str:
        return " ".join(text.casefold().split()).rstrip("?").strip()

    return norm(asked) == norm(own)


def task_question(params: RlmParams) -> str | None:
    """The generated task's own question (None for pasted text): what the Run tab's button puts in the prompt."""
    if params.task == "pasted":
        return None
    return tasks.make_task(params.task, params.context_tokens, params.task_seed).question


def prompt_needs(params: RlmParams) -> str:
    """What the prompt must hold (the empty-prompt message)."""
    if params.task == "pasted":
        return "a question about the text pasted in context_text"
    return 'a question about the generated document (the button "Ask the task\'s question" writes its own)'


def config_from(params: RlmParams) -> RlmConfig:
    limits = SandboxLimits(timeout_s=params.cell_timeout_s)
    return RlmConfig(
        params.mode, params.max_iterations, params.max_depth, params.max_sub_calls, params.max_total_tokens,
        params.sub_window, params.output_chars, params.max_new_tokens, limits=limits,
    )  # fmt: skip


def answer_events(loaded: LoadedModel, answer: str, limit: int, start: float) -> Iterator[TokenEmitted]:
    """The final answer as TokenEmitted events (it is the run's output text)."""
    ids = loaded.tokenizer(answer, add_special_tokens=False)["input_ids"][:limit]
    detokenizer = IncrementalDetokenizer(loaded.tokenizer)
    for step, token in enumerate(ids):
        text = detokenizer.push(token) + (detokenizer.flush() if step == len(ids) - 1 else "")
        yield TokenEmitted(step, token, text, "target", time.perf_counter() - start)


def run(loaded: LoadedModel, prompt_ids: list[int], params: RlmParams, generator: torch.Generator) -> Iterator[Event]:
    """RLM: root turns over a sandboxed REPL holding the context (the generator is unused: decoding is greedy)."""
    if params.mode == "code" and (refusal := code_mode_refusal()):
        raise InputError(refusal)
    start = time.perf_counter()
    context, question, expected = build_context(params, question_text(loaded, prompt_ids))
    context_tokens = len(loaded.tokenizer(context, add_special_tokens=False)["input_ids"])
    isolation = probe_isolation().trace_level
    yield RlmContext(
        0, question, params.task, expected, len(context), context_tokens, context[:200], params.mode, isolation
    )
    rlm = RlmRun(loaded, question, context, config_from(params))
    with Sandbox(context, rlm.config.limits) as sandbox:
        yield from rlm.events(sandbox)
    outcome = rlm.outcome
    correct = answer_matches(outcome.answer, expected) if expected else None
    read = sum(max(0, min(len(context), b) - max(0, a)) for a, b in _merge(outcome.reads))
    yield RlmResult(
        0, outcome.answer, correct, outcome.stop, outcome.root_calls, outcome.sub_calls, outcome.tokens, read
    )
    emitted = list(answer_events(loaded, outcome.answer, params.max_new_tokens, start))
    yield from emitted
    stop_reason = "eos" if outcome.stop == "final" else "max_new_tokens"
    yield RunFinished(len(emitted), stop_reason, time.perf_counter() - start, len(prompt_ids), outcome.forwards)


def _merge(ranges: list[list[int]]) -> list[list[int]]:
    """Union of [start, end) ranges."""
    merged: list[list[int]] = []
    for a, b in sorted(ranges):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


STRATEGY = Strategy(
    name="rlm",
    family="system 2",
    summary="Recursive LM: the root explores a long context held in a sandboxed REPL, with sub-model calls.",
    paper="Zhang, Kraska, Khattab 2025, Recursive Language Models (arXiv:2512.24601)",
    Params=RlmParams,
    run=run,
    prompt_hint=prompt_needs,
    task_prompt=("Ask the task's question", task_question),
)
