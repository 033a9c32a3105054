"""The RLM loop (Zhang, Kraska, Khattab 2025, Recursive Language Models): a root model that never sees the
long context, a sandboxed REPL that holds it, and sub-model calls the REPL makes through `llm_query`.

Each root turn: 1. the root model acts (code mode: writes text with ```repl blocks, as in the paper's system
prompt; action mode: picks one action of `lab.methods.rlm.actions`' grammar by constrained scoring, and writes the
answer of FINAL( itself), 2. the code runs
in the worker (`lab.methods.rlm.sandbox`), whose llm_query calls are served here as sub-calls (depth + 1), 3. the REPL
output, truncated to `output_chars`, goes back into the root's history, 4. the run stops at FINAL(answer) /
FINAL_VAR(name) (code mode: on a line of its own, `^\\s*FINAL\\((.*?)\\)` as in alexzhang13/rlm, or called in
the REPL), or at the iteration / token limit, when the root is asked once more for an answer.
Sub-calls: the sub-model sees "<text>\n\n<prompt>" as one chat turn, text cut to `sub_window` tokens; a text
longer than that is split in parts answered recursively one level deeper (then their answers are combined by
one more call) while depth < max_depth, and truncated (marked) at the depth limit. The paper's sub-calls are
plain LM calls at depth 1; the split-and-combine recursion for oversized texts is this lab's.
The same loaded model serves the root and the sub-calls (the paper pairs GPT-5 with GPT-5-mini).
Every call is traced as a `ReplCall` (call tree, ranges read, tokens, latency).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field

from lab.engine.models import LoadedModel
from lab.methods.rlm import actions, frames, lm
from lab.methods.rlm.sandbox import ExecResult, Sandbox, SandboxLimits
from lab.trace import Event, ReplCall

FINAL_VAR = re.compile(r"^\s*FINAL_VAR\((.*?)\)", re.M)  # alexzhang13/rlm's protocol: on a line of its own
FINAL = re.compile(r"^\s*FINAL\((.*?)\)", re.M)  # non-greedy, one line: "FINAL(42)\nThanks (really)." -> 42
VARIABLE = re.compile(r"[A-Za-z_]\w*")
REPL_BLOCK = re.compile(r"```(?:repl|python)[ \t]*\n(.*?)```", re.S)
NO_CODE = "No ```repl block found: write code, or answer with FINAL(answer)."
OUTPUT_SHOWN = 400  # characters of an output kept in the trace event

CODE_SYSTEM = """You are tasked with answering a query with associated context. You can access, transform, and \
analyze this context interactively in a REPL environment that can recursively query sub-LLMs. You will be \
queried iteratively until you provide a final answer.
The REPL environment is initialized with:
1. A `context` variable that contains the long text. Look at it in slices: context[a:b].
2. A `llm_query(prompt, text)` function that asks a sub-LLM `prompt` about `text` (keep text under {chars} \
characters) and returns its answer.
3. print() to see results; outputs are truncated to {output} characters.
Write Python code between ```repl and ``` to run it. Helpers: grep(pattern) prints matching lines, \
peek(start, end) returns a slice, chunks(k) returns k (start, end) ranges.
When you are done, answer with FINAL(your answer) or FINAL_VAR(variable_name), outside code."""


def _closed_block(text: str) -> bool:
    """Stop a root turn once it has written a complete ```repl block (the REPL answers before it goes on)."""
    return REPL_BLOCK.search(text) is not None


@dataclass(frozen=True)
class RlmConfig:
    mode: str = "action"  # action | code
    max_iterations: int = 6
    max_depth: int = 2
    max_sub_calls: int = 64
    max_total_tokens: int = 100_000
    sub_window: int = 1024
    output_chars: int = 800
    root_max_tokens: int = 256
    sub_max_tokens: int = 24
    limits: SandboxLimits = field(default_factory=SandboxLimits)


@dataclass
class Outcome:
    answer: str = ""
    stop: str = "max_iterations"  # final | max_iterations | token_budget
    root_calls: int = 0
    sub_calls: int = 0
    tokens: int = 0
    forwards: int = 0
    reads: list[list[int]] = field(default_factory=list)


class RlmRun:
    """One RLM run over `context`; `events(sandbox)` yields ReplCall events and fills `outcome`."""

    def __init__(self, loaded: LoadedModel, question: str, context: str, config: RlmConfig) -> None:
        self.loaded, self.question, self.context, self.config = loaded, question, context, config
        self.outcome = Outcome()
        self.next_id = 0
        self.started = time.perf_counter()

    # --- shared pieces --------------------------------------------------------------------------------------

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def _count(self, prompt_tokens: int, output_tokens: int, forwards: int) -> None:
        self.outcome.tokens += prompt_tokens + output_tokens
        self.outcome.forwards += forwards

    def _budget_left(self) -> bool:
        return self.outcome.tokens < self.config.max_total_tokens

    def _execute(self, sandbox: Sandbox, code: str, parent: int, depth: int) -> Generator[Event, None, ExecResult]:
        """Run a cell, serving its llm_query calls as sub-calls one level below `parent`."""
        cell = sandbox.execute(code)
        try:
            query = next(cell)
            while True:
                answer = yield from self._sub_call(query.prompt, query.text, query.ranges, parent, depth + 1)
                query = cell.send(answer)
        except StopIteration as stop:
            result: ExecResult = stop.value
        self.outcome.reads.extend(result.reads)
        return result

    def _sub_call(
        self, prompt: str, text: str, ranges: list[list[int]], parent: int, depth: int
    ) -> Generator[Event, None, str]:
        """llm_query(prompt, text) at `depth`: recurse over parts of an oversized text, else one model call."""
        call_id, start = self._new_id(), time.perf_counter()
        self.outcome.reads.extend(ranges)
        if self.outcome.sub_calls >= self.config.max_sub_calls or not self._budget_left():
            error = "sub-call limit reached" if self._budget_left() else "token budget exhausted"
            yield ReplCall(
                call_id, call_id, parent, depth, "sub", prompt[:OUTPUT_SHOWN], "", ranges, "", error, 0, 0, 0.0
            )
            return f"[error: {error}]"
        self.outcome.sub_calls += 1
        text_ids = self.loaded.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        note = ""
        if len(text_ids) > self.config.sub_window and depth < self.config.max_depth:
            parts = min(4, math.ceil(len(text_ids) / self.config.sub_window))
            size = math.ceil(len(text) / parts)
            offset = ranges[0][0] if ranges else None
            answers = []
            for i in range(parts):
                piece = text[i * size : (i + 1) * size]
                start = offset + i * size if offset is not None else None
                piece_range = [] if start is None else frames.ranges([[start, start + len(piece)]], len(self.context))
                answer = yield from self._sub_call(prompt, piece, piece_range, call_id, depth + 1)
                answers.append(f"Part {i + 1}: {answer.strip()}")
            text, note = "\n".join(answers), f"combined {parts} parts"
        elif len(text_ids) > self.config.sub_window:
            text, note = self.loaded.decode(text_ids[: self.config.sub_window]), "text truncated at the depth limit"
        ids = self.loaded.encode(f"{text}\n\n{prompt}" if text else prompt, chat=True)
        gen = lm.generate(self.loaded, ids, self.config.sub_max_tokens)
        self._count(gen.prompt_tokens, gen.output_tokens, gen.forwards)
        yield ReplCall(
            call_id, call_id, parent, depth, "sub", prompt[:OUTPUT_SHOWN], note, ranges, gen.text[:OUTPUT_SHOWN], "",
            gen.prompt_tokens, gen.output_tokens, round(time.perf_counter() - start, 4),
        )  # fmt: skip
        return gen.text

    # --- action mode ------------------------------------------------------------------------------------------

    def _choose(self, state: actions.ActionState, allowed: list[actions.Action]) -> lm.Choice:
        """Constrained decoding: greedy over the token trie of the allowed actions, after the few-shot prompt."""
        ids = self.loaded.tokenizer(actions.prompt(state, self.config.output_chars))["input_ids"]
        choice = lm.choose(self.loaded, ids, [" " + a.text for a in allowed])
        self._count(choice.prompt_tokens, choice.trie_tokens, 2)
        return choice

    def _generate_answer(self, state: actions.ActionState) -> tuple[str, lm.Generation]:
        """The model's own ANSWER after "Action: FINAL(": greedy, up to ")" or the end of the line."""
        text = actions.prompt(state, self.config.output_chars) + " " + actions.FINAL_PREFIX
        ids = self.loaded.tokenizer(text)["input_ids"]
        gen = lm.generate(self.loaded, ids, actions.ANSWER_TOKENS, stop=lambda t: ")" in t or "\n" in t)
        self._count(gen.prompt_tokens, gen.output_tokens, gen.forwards)
        return re.split(r"[)\n]", gen.text, maxsplit=1)[0].strip().strip("\"'"), gen

    def _action_turn(self, sandbox: Sandbox, state: actions.ActionState, last: bool) -> Generator[Event, None, bool]:
        """One constrained root turn; returns True when it answered."""
        call_id, start = self._new_id(), time.perf_counter()
        chunk_chars = int(self.config.sub_window * 2.5)
        sub_left = self.config.max_sub_calls - self.outcome.sub_calls
        allowed = actions.candidates(state, actions.map_chunks(len(self.context), chunk_chars, sub_left))
        finals = [a for a in allowed if a.kind == "final"]
        if last and finals:
            allowed = finals  # out of steps: the model must answer now
        choice = self._choose(state, allowed)
        action = allowed[choice.index]
        output_tokens = choice.trie_tokens
        if action.kind == "final":
            answer, gen = self._generate_answer(state)
            action, output_tokens = actions.Action("final", (answer,)), output_tokens + gen.output_tokens
        self.outcome.root_calls += 1
        result = yield from self._execute(sandbox, action.code(), call_id, 0)
        observation = result.transcript
        state.history.append((action, observation))
        if action.kind == "final":
            self.outcome.answer, self.outcome.stop = str(action.args[0]), "final"
        yield ReplCall(
            call_id, call_id, -1, 0, "root", action.code(), action.text, result.reads, observation[:OUTPUT_SHOWN],
            result.error or "", choice.prompt_tokens, output_tokens, round(time.perf_counter() - start, 4),
            str(action.args[0]) if action.kind == "final" else None, [a.text for a in allowed], choice.logprobs,
        )  # fmt: skip
        return action.kind == "final"

    def _run_actions(self, sandbox: Sandbox) -> Iterator[Event]:
        prefix = self.context[:60]
        state = actions.ActionState(self.question, len(self.context), prefix)
        for iteration in range(self.config.max_iterations):
            if not self._budget_left():
                self.outcome.stop = "token_budget"
                break
            done = yield from self._action_turn(sandbox, state, last=iteration == self.config.max_iterations - 1)
            if done:
                return

    # --- code mode --------------------------------------------------------------------------------------------

    def _root_generate(self, messages: list[dict]) -> lm.Generation:
        """One root turn in code mode; oldest exchanges are dropped until the prompt fits the window."""
        budget = lm.window(self.loaded) - self.config.root_max_tokens - 8
        while True:
            text = self._render(messages)
            ids = self.loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) <= budget or len(messages) <= 3:
                break
            messages = messages[:2] + messages[4:]
        gen = lm.generate(self.loaded, ids, self.config.root_max_tokens, stop=_closed_block)
        self._count(gen.prompt_tokens, gen.output_tokens, gen.forwards)
        self.outcome.root_calls += 1
        return gen

    def _render(self, messages: list[dict]) -> str:
        """The chat-templated root prompt (plain "role: text" turns for tokenizers without a template)."""
        tokenizer = self.loaded.tokenizer
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "

    def _code_turn(self, sandbox: Sandbox, messages: list[dict]) -> Generator[Event, None, bool]:
        """One free-form root turn: run its ```repl blocks, then look for FINAL / FINAL_VAR."""
        call_id, start = self._new_id(), time.perf_counter()
        gen = self._root_generate(messages)
        blocks = REPL_BLOCK.findall(gen.text)
        prose = REPL_BLOCK.sub("", gen.text)
        outputs, reads, errors, final = [], [], [], None
        for code in blocks:
            result = yield from self._execute(sandbox, code, call_id, 0)
            outputs.append(result.transcript)
            reads += result.reads
            errors += [result.error] if result.error else []
            final = result.final if result.final is not None else final
        if final is None and (name := final_var_name(prose)):
            result = yield from self._execute(sandbox, f"FINAL_VAR({name!r})", call_id, 0)
            final, errors = result.final, errors + ([result.error] if result.error else [])
        elif final is None and (answer := final_answer(prose)) is not None:
            final = answer
        observation = "\n".join(outputs) if blocks else NO_CODE
        messages += [{"role": "assistant", "content": gen.text}, {"role": "user", "content": self._shown(observation)}]
        if final is not None:
            self.outcome.answer, self.outcome.stop = final, "final"
        yield ReplCall(
            call_id, call_id, -1, 0, "root", "\n\n".join(blocks) or gen.text[:OUTPUT_SHOWN], "", reads,
            observation[:OUTPUT_SHOWN], "; ".join(errors), gen.prompt_tokens, gen.output_tokens,
            round(time.perf_counter() - start, 4), final,
        )  # fmt: skip
        return final is not None

    def _shown(self, observation: str) -> str:
        cap = self.config.output_chars
        return "REPL output:\n" + (observation if len(observation) <= cap else observation[:cap] + "\n[truncated]")

    def _run_code(self, sandbox: Sandbox) -> Iterator[Event]:
        system = CODE_SYSTEM.format(chars=int(self.config.sub_window * 2.5), output=self.config.output_chars)
        metadata = (
            f"The context is a string of {len(self.context)} characters. It starts with: {self.context[:200]!r}\n"
            f"Query: {self.question}"
        )
        messages = [{"role": "system", "content": system}, {"role": "user", "content": metadata}]
        for _ in range(self.config.max_iterations):
            if not self._budget_left():
                self.outcome.stop = "token_budget"
                return
            done = yield from self._code_turn(sandbox, messages)
            if done:
                return
        messages.append({"role": "user", "content": "You have no steps left. Answer now with FINAL(your answer)."})
        gen = self._root_generate(messages)
        answer = final_answer(gen.text)
        self.outcome.answer = answer if answer is not None else gen.text.strip()

    def events(self, sandbox: Sandbox) -> Iterator[Event]:
        """The run's ReplCall events; `self.outcome` holds the answer and totals afterwards."""
        if self.config.mode == "code":
            yield from self._run_code(sandbox)
        else:
            yield from self._run_actions(sandbox)


def final_answer(text: str) -> str | None:
    """The answer of a FINAL(...) that starts a line (alexzhang13/rlm's `^\\s*FINAL\\((.*?)\\)`), unquoted."""
    match = FINAL.search(text)
    return match.group(1).strip().strip("\"'") if match else None


def final_var_name(text: str) -> str | None:
    """The variable of a FINAL_VAR(name) that starts a line, when it is an identifier (quotes allowed)."""
    match = FINAL_VAR.search(text)
    name = match.group(1).strip().strip("\"'") if match else ""
    return name if VARIABLE.fullmatch(name) else None


def answer_matches(answer: str, expected: str) -> bool:
    """Exact match after normalisation: the first number when the expected answer is a number, else the text."""
    if re.fullmatch(r"-?\d+", expected.strip()):
        numbers = re.findall(r"-?\d+", answer.replace(",", ""))
        return bool(numbers) and numbers[0] == expected.strip()
    return answer.strip().strip(".").lower() == expected.strip().strip(".").lower()
