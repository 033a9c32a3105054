"""The constrained action grammar of RLM's action mode: what a small model may do at each step, the few-shot
prompt it chooses from, and the REPL code each action becomes.

A 135M model cannot write RLM's Python, so each root turn picks one action from a small grammar:
    action := grep("TERM") | peek(START, END) | map("QUESTION", K) | add() | FINAL(ANSWER)
where TERM ranges over the question's key words and names, START/END over windows around the last grep hits
(and the document's start), K is fixed by the context length and the sub-call budget. The helpers are generic:
grep prints matching lines with their offsets (the first 20, nothing counted or summed), map splits the
context into K chunks and `llm_query`s the question on each (the sub-model's answers are printed), add() sums
the first number of each map answer (the combine step of split / query / combine, chosen by the model, never
run for it). The caller scores the allowed actions with the model constrained to their strings
(`lab.methods.rlm.lm.choose`: masked log-probs over the token trie of the candidates, exact argmax); when it picks
"FINAL(", the ANSWER is the model's own greedy continuation up to ")" (`lab.methods.rlm.lm.generate`), not a choice
among printed values. Each action becomes ordinary REPL code (`Action.code`), run by the same sandbox as code
mode, calling its helpers grep / peek / chunks / llm_query on `context`.
Deliberate differences from the paper (which lets a frontier model write any code): the grammar and the
candidate arguments are the project's; FINAL is only offered after at least one observation, and an action is
never repeated.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_STOPWORDS_TEXT = (
    "a an the of in on at to for from by with and or is are was were be been what which who whom whose how many "
    "much did does do have has had in total all any there their its it this that these those buy bought units "
    "give tell me please find number value"
)
STOPWORDS = frozenset(_STOPWORDS_TEXT.split(" "))
MAX_TERMS, MAX_PEEKS, ANSWER_TOKENS = 6, 3, 12
HIT = re.compile(r"^\[(\d+):(\d+)\] (.*)$", re.M)
FINAL_PREFIX = "FINAL("

INSTRUCTIONS = """You answer questions about a long document. It is stored in a Python REPL as the variable `context`; \
you never see it whole. Each step, choose one action:
grep("word") prints the first lines that contain a word, with their positions.
peek(start, end) prints the characters from start to end.
map("question", k) splits the document into k chunks and asks a helper model the question about each chunk.
add() adds up the numbers the helper model answered for the chunks.
FINAL(answer) gives the answer.
"""

EXAMPLES = """Question: What is the secret code of Anna Berg?
Document: 90512 characters, starting: 'Entry 00000: rain in Bonn'.
Action: grep("Anna Berg")
Result:
[40211:40249] The secret code of Anna Berg is 55120.
Action: FINAL(55120)

Question: How many parcels have status delayed?
Document: 120344 characters, starting: 'Entry 00000: wind in Graz'.
Action: map("How many parcels have status delayed?", 4)
Result:
chunk 0 [0:30086]: 5
chunk 1 [30086:60172]: 7
chunk 2 [60172:90258]: 6
chunk 3 [90258:120344]: 5
Action: add()
Result:
sum of the chunk answers: 23
Action: FINAL(23)

Question: How many apples did Lars Holm pick in total?
Document: 60219 characters, starting: 'Entry 00000: fog in Kiel'.
Action: grep("Lars Holm")
Result:
[7012:7049] Crate 3301: Lars Holm picked 30 apples.
[19924:19961] Crate 8120: Lars Holm picked 21 apples.
[40150:40187] Crate 5512: Lars Holm picked 13 apples.
Action: map("How many apples did Lars Holm pick in total?", 3)
Result:
chunk 0 [0:20073]: 30
chunk 1 [20073:40146]: 21
chunk 2 [40146:60219]: 13
Action: add()
Result:
sum of the chunk answers: 64
Action: FINAL(64)
"""


@dataclass(frozen=True)
class Action:
    kind: str  # grep | peek | map | add | final
    args: tuple  # final: (answer,) once generated; () while it is the bare "FINAL(" choice

    @property
    def text(self) -> str:
        """How the action is written in the prompt (the string the model is scored on)."""
        if self.kind == "grep":
            return f'grep("{self.args[0]}")'
        if self.kind == "peek":
            return f"peek({self.args[0]}, {self.args[1]})"
        if self.kind == "map":
            return f'map("{self.args[0]}", {self.args[1]})'
        if self.kind == "add":
            return "add()"
        return FINAL_PREFIX + (f"{self.args[0]})" if self.args else "")

    def code(self) -> str:
        """The REPL code this action runs (arguments are repr()-quoted: no injection from the context)."""
        if self.kind == "grep":
            return f"_hits = grep(re.escape({self.args[0]!r}))"
        if self.kind == "peek":
            return f"print(peek({int(self.args[0])}, {int(self.args[1])}))"
        if self.kind == "map":
            return (
                "_answers = []\n"
                f"for _i, (_a, _b) in enumerate(chunks({int(self.args[1])})):\n"
                f"    _answers.append(llm_query({self.args[0]!r}, context[_a:_b]))\n"
                "    print(f'chunk {_i} [{_a}:{_b}]: ' + _answers[-1].strip().replace(chr(10), ' ')[:80])"
            )
        if self.kind == "add":
            return (
                "_numbers = [re.findall(r'-?\\d+', _a.replace(',', ''))[:1] for _a in _answers]\n"
                "print('sum of the chunk answers:', sum(int(_n[0]) for _n in _numbers if _n))"
            )
        return f"FINAL({self.args[0]!r})"


@dataclass
class ActionState:
    """What the root has seen: the question, the context size and prefix, and each (action, observation)."""

    question: str
    context_chars: int
    prefix: str
    history: list[tuple[Action, str]] = field(default_factory=list)


def key_terms(question: str) -> list[str]:
    """Grep terms: names (runs of capitalised words), then single content words, longest first."""
    words = re.findall(r"[A-Za-z][A-Za-z'-]+|\d+", question)
    names = [" ".join(m) for m in re.findall(r"\b([A-Z][a-z]+) ([A-Z][a-z]+)\b", question)]
    singles = [w for i, w in enumerate(words) if w.lower() not in STOPWORDS and (i > 0 or not w[0].isupper())]
    singles += [w for w in words[:1] if w[0].isupper() and w.lower() not in STOPWORDS]
    ordered = names + sorted(dict.fromkeys(singles), key=lambda w: (-len(w), w))
    return list(dict.fromkeys(ordered))[:MAX_TERMS]


def candidates(state: ActionState, map_k: int) -> list[Action]:
    """Every action the grammar allows now (never one already taken): map only when map_k >= 2, add() only after
    a map, the bare "FINAL(" only after an observation (its answer is generated, see the module docstring)."""
    done = {action for action, _ in state.history}
    options = [Action("grep", (term,)) for term in key_terms(state.question)]
    if state.history:
        for start, end, _ in HIT.findall(state.history[-1][1])[:MAX_PEEKS]:
            options.append(Action("peek", (max(0, int(start) - 150), min(state.context_chars, int(end) + 150))))
    options.append(Action("peek", (0, min(state.context_chars, 600))))
    if map_k >= 2:
        options.append(Action("map", (state.question, map_k)))
    if any(action.kind == "map" for action in done):
        options.append(Action("add", ()))
    if state.history:
        options.append(Action("final", ()))
    return [action for action in options if action not in done]


def map_chunks(context_chars: int, chunk_chars: int, sub_calls_left: int) -> int:
    """K for map: enough chunks for each to fit a sub-call, at most the sub-calls left (0 = map not allowed)."""
    k = max(2, math.ceil(context_chars / max(1, chunk_chars)))
    return min(k, sub_calls_left) if sub_calls_left >= 2 else 0


def prompt(state: ActionState, output_chars: int) -> str:
    """The few-shot prompt the actions are scored after (it ends with "Action:")."""
    lines = [INSTRUCTIONS, EXAMPLES, f"Question: {state.question}"]
    lines.append(f"Document: {state.context_chars} characters, starting: {state.prefix!r}.")
    for action, observation in state.history:
        shown = observation if len(observation) <= output_chars else observation[:output_chars] + "\n[truncated]"
        lines.append(f"Action: {action.text}\nResult:\n{shown.rstrip()}")
    return "\n".join(lines) + "\nAction:"
