"""Tree of Thoughts (Yao et al. 2023, arXiv:2305.10601): decoding thought by thought with search.

Each step generates k candidate thoughts per frontier state, values them (the model's sure / likely /
impossible verdict read from next-word log-probabilities, a vote prompt, or Game of 24's exact solver) and keeps
the best b (BFS, Alg. 1), or explores best-first with pruning and backtracking (DFS, Alg. 2). The prompt box
holds the task input: a Game of 24 hand ("4 9 10 13"), the sentences (or topic) to write about, or a question.
Game of 24 thoughts are decoded under a legality constraint (every legal move line scored in one tree-attention
forward, k drawn from the renormalized distribution), so the 135M model writes only valid steps; see
`lab.methods.tot` for the tasks, prompts, model calls and search. The chat-templated prompt is unwrapped back to the
user's text; every model call uses raw few-shot prompts.
Output: ThoughtNode / ThoughtStep events while searching, a ThoughtResult, then the answer (the final path's
text) as TokenEmitted events and RunFinished. `max_new_tokens` caps each sampled thought of the text tasks
(creative plans at most 96 tokens); Game of 24 lines are not sampled token by token. RunFinished counts every
model forward (prefix prefills, scoring forwards, sampling steps) as target forwards.
Not covered: thought generation by a separate proposer model, the paper's crossword task, GPT-4 scale.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lab.engine.models import LoadedModel
from lab.engine.text import IncrementalDetokenizer
from lab.methods.tot.lm import CallModel
from lab.methods.tot.search import SEARCHES, VALUE_MODES, SearchConfig, TreeSearch
from lab.methods.tot.tasks import INPUTS, TASKS, make_task
from lab.params import DecodeParams, param
from lab.registry import Strategy
from lab.trace import Event, RunFinished, ThoughtResult, TokenEmitted

PROMPT_MARKER = "\u2063TOT-PROMPT\u2063"


@dataclass(frozen=True)
class ToTParams(DecodeParams):
    task: str = param(
        "game24", choices=tuple(TASKS), help="Game of 24 (hand in the prompt), creative writing, question."
    )
    search: str = param("bfs", choices=SEARCHES, help="bfs: keep the b best states per step (Alg. 1); dfs: Alg. 2.")
    value: str = param(
        "model", choices=VALUE_MODES, help="V(s): model sure/likely/impossible, vote of the model, exact solver (24)."
    )
    k: int = param(8, low=1, high=32, help="Thoughts generated per frontier state: G(p, s, k).")
    breadth: int = param(5, low=1, high=16, help="b: states kept after each BFS step (S_t = best b of S'_t).")
    steps: int = param(3, low=1, high=8, help="T for questions (Game of 24: numbers - 1; creative writing: 2).")
    temperature: float = param(
        0.7, low=0.05, high=2.0, help="Thought sampling p^(1/T) (over legal moves for Game of 24); votes too."
    )
    n_votes: int = param(5, low=1, high=20, help="Votes sampled per vote prompt; V = share of the votes.")
    prune_below: float = param(0.05, low=0.0, high=1.0, help="DFS prunes a thought with V < this (V in [0, 1]).")
    max_expansions: int = param(
        20, low=1, high=200, help="DFS: states expanded before it gives up.", only_when=("search", "dfs")
    )


def prompt_text(loaded: LoadedModel, prompt_ids: list[int]) -> str:
    """The user's text: the prompt ids with the chat template's wrapping removed (raw prompts pass through)."""
    full = loaded.tokenizer.decode(prompt_ids, skip_special_tokens=False)
    if getattr(loaded.tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": PROMPT_MARKER}]
        rendered = loaded.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        head, _, tail = rendered.partition(PROMPT_MARKER)
        if full.startswith(head) and full.endswith(tail) and len(full) >= len(head) + len(tail):
            return full[len(head) : len(full) - len(tail)]
    return loaded.decode(prompt_ids)


def run(loaded: LoadedModel, prompt_ids: list[int], params: ToTParams, generator: torch.Generator) -> Iterator[Event]:
    """Checks the task input and the parameter combination eagerly (InputError), then streams the search."""
    task = make_task(params.task, prompt_text(loaded, prompt_ids), params.steps, params.max_new_tokens)
    config = SearchConfig(
        search=params.search,
        value=params.value,
        k=params.k,
        breadth=params.breadth,
        temperature=params.temperature,
        n_votes=params.n_votes,
        prune_below=params.prune_below,
        max_expansions=params.max_expansions,
    )
    return stream(TreeSearch(task, CallModel(loaded), config, generator), loaded, len(prompt_ids))


def stream(search: TreeSearch, loaded: LoadedModel, prompt_tokens: int) -> Iterator[Event]:
    """1. the search's events, 2. the answer text token by token, 3. RunFinished; caches freed in `finally`."""
    start = time.perf_counter()
    try:
        result = None
        for event in search.run():  # 1.
            result = event if isinstance(event, ThoughtResult) else result
            yield event
        ids = search.lm.encode(result.answer)
        detokenizer = IncrementalDetokenizer(loaded.tokenizer)
        for step, token in enumerate(ids):  # 2.
            text = detokenizer.push(token) + (detokenizer.flush() if step + 1 == len(ids) else "")
            yield TokenEmitted(step, token, text, "target", time.perf_counter() - start)
        wall = time.perf_counter() - start
        yield RunFinished(len(ids), "eos", wall, prompt_tokens, search.lm.usage.forwards)  # 3.
    finally:
        search.lm.close()


STRATEGY = Strategy(
    name="tot",
    family="system 2",
    summary="Tree of Thoughts: k thoughts per state, valued by the model (or a solver / votes), BFS or DFS.",
    paper="Yao et al. 2023, Tree of Thoughts: Deliberate Problem Solving with Large Language Models "
    "(arXiv:2305.10601), Alg. 1-2",
    Params=ToTParams,
    run=run,
    prompt_hint=lambda params: INPUTS[params.task],
)
