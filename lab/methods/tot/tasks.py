"""The three Tree of Thoughts tasks (Yao et al. 2023, Sec. 4.1-4.2 and a free-form variant): what a thought
is, how k of them are generated from a state, how the model is asked to value one, and what the answer is.

- Game of 24: a thought is one line "a op b = c (left: ...)"; a state is the numbers left; T = numbers - 1.
  Generation is the paper's "propose" prompt decoded under a legality constraint: every legal move of the
  state (lab.methods.tot.game24) is scored in one forward (`CallModel.score`, a token trie over "a op b = c (left:",
  the rest of the line being forced) and k distinct moves are drawn without replacement from p(m)^(1/T) / Z
  over the legal set (Gumbel top-k), so even a 135M model only writes legal steps.
  The last state (one number) is checked exactly, whatever the value mode.
- Creative writing: T = 2, a plan then a passage, k i.i.d. samples each (the paper's "sample" generator).
- Free-form question: a thought is one sentence (a line); a line starting "Answer:" ends the path; T = steps.
Model value: the state is shown to a sure / likely / impossible prompt and the verdict read from next-word
probabilities (`lab.methods.tot.prompts`); the solver value (Game of 24 only) is exact solvability.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

import torch

from lab.methods.tot import game24, prompts
from lab.methods.tot.lm import CallModel
from lab.params import InputError

JUDGE = """Judge whether the text so far is correct and on track to complete the task (sure/likely/impossible).
Task: {task}
Text:
"""
PLAN_TOKENS = 96


@dataclass(frozen=True)
class Thought:
    text: str
    state: object  # Game of 24: tuple of Fractions left; text tasks: tuple of thought texts so far
    logprob: float | None = None


def sample_distinct(logps: list[float], k: int, temperature: float, generator: torch.Generator) -> list[int]:
    """k distinct indices drawn without replacement from softmax(logps / T) (Gumbel top-k)."""
    scores = torch.tensor(logps, dtype=torch.float64, device=generator.device) / temperature
    uniform = torch.rand(len(logps), generator=generator, dtype=torch.float64, device=generator.device)
    uniform = uniform.clamp_min(1e-300)
    perturbed = scores - torch.log(-torch.log(uniform))
    return perturbed.argsort(descending=True)[:k].tolist()


def scored_part(move: game24.Move) -> str:
    """The part of a move line whose probability is scored: "a op b = c (left:". The numbers after it are
    determined by the move, so constrained decoding would force them (probability 1 under the constraint);
    scoring through "(left:" also closes the result number ("= 4" cannot continue as "= 45")."""
    return move.text.split(" (left:")[0] + " (left:"


class Game24:
    name, has_solver = "game24", True

    def __init__(self, text: str) -> None:
        self.numbers = game24.parse_puzzle(text)
        self.start = game24.as_state(self.numbers)
        self.depth = len(self.numbers) - 1

    def root(self) -> Thought:
        return Thought(game24.state_text(self.start), self.start)

    def propose_many(
        self, lm: CallModel, states: list[tuple], k: int, temperature: float, gen: torch.Generator
    ) -> list[list[Thought]]:
        """k legal moves per state; every state's moves are scored in the same forward."""
        moves = [game24.legal_moves(state) for state in states]
        suffixes = [f"{game24.state_text(s)}\nPossible next steps:\n" for s in states]
        queries = [(suffix, [scored_part(m) for m in ms]) for suffix, ms in zip(suffixes, moves, strict=True)]
        thoughts = []
        for options, logps in zip(moves, lm.score_many(prompts.GAME24_PROPOSE, queries), strict=True):
            norm = torch.logsumexp(torch.tensor(logps, dtype=torch.float64), 0).item()
            picks = sample_distinct(logps, k, temperature, gen)
            thoughts.append([Thought(options[i].text, options[i].left, logps[i] - norm) for i in picks])
        return thoughts

    def is_terminal(self, state: tuple, depth: int) -> bool:
        return len(state) == 1

    def is_solution(self, state: tuple, depth: int) -> bool:
        return len(state) == 1 and state[0] == game24.TARGET

    def exact_value(self, state: tuple) -> float | None:
        return (1.0 if state[0] == game24.TARGET else 0.0) if len(state) == 1 else None

    def solver_value(self, state: tuple) -> float:
        return 1.0 if game24.solvable(state) else 0.0

    def value_query(self, state: tuple) -> tuple[str, str]:
        return prompts.GAME24_VALUE, f"{game24.state_text(state)}:"

    def instruction(self) -> str:
        return f"Use the numbers {game24.state_text(self.start)} and + - * / to obtain 24, two numbers per step."

    def choice(self, path: list[Thought]) -> str:
        return "\n".join(t.text for t in path[1:])

    def answer(self, path: list[Thought]) -> str:
        lines = [t.text for t in path[1:]]
        if self.is_solution(path[-1].state, len(path) - 1):
            moves = _replay(self.start, lines)
            lines.append(f"Answer: {game24.expression(self.start, moves)} = 24")
        else:
            lines.append("No solution found.")
        return "\n".join(lines)


def _replay(start: tuple[Fraction, ...], lines: list[str]) -> list[game24.Move]:
    """The moves a path's lines spell (each line is a legal move of the state before it)."""
    state, moves = start, []
    for line in lines:
        move = next(m for m in game24.legal_moves(state) if m.text == line)
        moves.append(move)
        state = move.left
    return moves


class TextTask:
    """Shared by the creative-writing and free-form tasks: thoughts sampled as text, valued by the judge prompt."""

    name, has_solver, depth = "text", False, 1
    max_tokens = 64

    def __init__(self, text: str) -> None:
        self.text = text.strip()

    def root(self) -> Thought:
        return Thought(self.text, ())

    def sample(
        self,
        lm: CallModel,
        prefix: str,
        suffix: str,
        k: int,
        temperature: float,
        gen: torch.Generator,
        stops: tuple[str, ...],
        max_tokens: int,
    ) -> list[str]:
        texts = lm.sample(prefix, suffix, k, temperature=temperature, max_tokens=max_tokens, stops=stops, generator=gen)
        return list(dict.fromkeys(t.strip() for t in texts if t.strip()))  # siblings deduplicated, order kept

    def propose_many(
        self, lm: CallModel, states: list[tuple], k: int, temperature: float, gen: torch.Generator
    ) -> list[list[Thought]]:
        return [self.propose(lm, state, k, temperature, gen) for state in states]

    def is_solution(self, state: tuple, depth: int) -> bool:
        return self.is_terminal(state, depth)

    def exact_value(self, state: tuple) -> float | None:
        return None

    def solver_value(self, state: tuple) -> float:
        raise InputError(f"The {self.name} task has no exact solver; use value = model or vote.")

    def value_query(self, state: tuple) -> tuple[str, str]:
        return JUDGE.format(task=self.instruction()), "\n".join(state) + "\nJudgement:"

    def choice(self, path: list[Thought]) -> str:
        return "\n".join(path[-1].state)

    def answer(self, path: list[Thought]) -> str:
        return "\n".join(path[-1].state)


class Creative(TextTask):
    name, depth = "creative", 2

    def instruction(self) -> str:
        sentences = [s for s in re.split(r"(?<=[.!?])\s+", self.text) if s]
        if len(sentences) >= 2:
            return prompts.CREATIVE_SENTENCES.format(n=len(sentences), sentences=" ".join(sentences)).strip()
        return prompts.CREATIVE_TOPIC.format(topic=self.text).strip()

    def propose(self, lm: CallModel, state: tuple, k: int, temperature: float, gen: torch.Generator) -> list[Thought]:
        prefix = self.instruction() + "\n" + prompts.CREATIVE_FORMAT
        if not state:  # step 1: plans
            plans = self.sample(lm, prefix, "", k, temperature, gen, ("\n\n", "Passage:"), min(self.max_tokens, 96))
            return [Thought(p, (f"Plan:\n{p}",)) for p in plans]
        plan = state[0].removeprefix("Plan:\n")
        passages = self.sample(lm, prefix, f"{plan}\n\nPassage:\n", k, temperature, gen, ("\nPlan:",), self.max_tokens)
        return [Thought(p, (*state, f"Passage:\n{p}")) for p in passages]

    def is_terminal(self, state: tuple, depth: int) -> bool:
        return depth >= self.depth


class Question(TextTask):
    name = "question"

    def instruction(self) -> str:
        return self.text

    def propose(self, lm: CallModel, state: tuple, k: int, temperature: float, gen: torch.Generator) -> list[Thought]:
        suffix = "".join(line + "\n" for line in state)
        prefix = prompts.QUESTION_STEPS.format(question=self.text)
        lines = self.sample(lm, prefix, suffix, k, temperature, gen, ("\n",), self.max_tokens)
        return [Thought(line, (*state, line)) for line in lines]

    def is_terminal(self, state: tuple, depth: int) -> bool:
        return depth >= self.depth or bool(state) and state[-1].startswith("Answer:")


TASKS = {"game24": Game24, "creative": Creative, "question": Question}
# what each task reads from the prompt box (the empty-prompt message and the text tasks' refusal say it)
INPUTS = {
    "game24": f"{game24.MIN_NUMBERS} to {game24.MAX_NUMBERS} whole numbers, the Game of 24 hand (such as 4 9 10 13)",
    "creative": "the sentences (or the topic) to write about",
    "question": "the question to reason about",
}


def make_task(name: str, text: str, steps: int, max_tokens: int) -> Game24 | TextTask:
    """The task `name` on the prompt text; `steps` sets T of the free-form task, `max_tokens` caps a sampled
    thought. InputError when the prompt does not fit the task."""
    if name not in TASKS:
        raise InputError(f"Unknown task {name!r}; choose one of {', '.join(TASKS)}.")
    task = TASKS[name](text)
    if isinstance(task, TextTask):
        if not task.text:
            raise InputError(f"The {name} task needs {INPUTS[name]}; the prompt is empty.")
        task.max_tokens = max_tokens
        if isinstance(task, Question):
            task.depth = steps
    return task


def value_from_logps(logps: list[float]) -> tuple[float, str]:
    """V = sum_w p(w) v(w) / 20 with p renormalized over sure / likely / impossible (the paper's value map,
    scaled to [0, 1]) and the most likely word."""
    top = max(logps)
    weights = [math.exp(lp - top) for lp in logps]
    total = sum(weights)
    value = sum(w / total * prompts.VALUE_MAP[word] for w, word in zip(weights, prompts.VALUE_WORDS, strict=True))
    return value / prompts.VALUE_MAP["sure"], prompts.VALUE_WORDS[weights.index(max(weights))]
