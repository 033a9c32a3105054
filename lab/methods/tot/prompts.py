"""Prompt texts of the Tree of Thoughts tasks, adapted from the paper's released prompts (Yao et al. 2023,
github.com/princeton-nlp/tree-of-thought-llm, src/tot/prompts/{game24,text}.py).

Each prompt is split into a fixed few-shot PREFIX (KV-cached once per run by `lab.methods.tot.lm`) and a per-call
suffix. Differences from the paper's texts, all deliberate for a 135M model and for reading the value from
next-word probabilities:
- Game of 24 value: the examples keep the paper's numbers and verdicts but drop the reasoning lines, and the
  query ends right before the verdict ("4 4 10:"), so p(sure / likely / impossible) is read from one forward
  instead of sampling three reasoned completions.
- Vote prompts end with "The best choice is" (no written analysis) and the vote is read from the full-sequence
  p(" 1\n" ... " k\n"): the terminator matters because SmolLM2 splits digits, so p(" 1") alone would include
  every " 1x" choice; value verdicts are likewise scored as " sure\n" / " likely\n" / " impossible\n".
- Creative writing asks for "a short plan, one line per paragraph, then the passage" instead of the paper's
  "Plan: Your plan here. Passage: Your passage here." template, which the 135M model copies verbatim.
- Free-form questions use a one-sentence-per-line format ending with "Answer: ..." (not in the paper).
The Game of 24 propose and chain-of-thought examples are the paper's (one typo fixed); no evaluation puzzle of
lab/methods/tot/puzzles.json appears in them.
"""

from __future__ import annotations

GAME24_PROPOSE = """Input: 2 8 8 14
Possible next steps:
2 + 8 = 10 (left: 8 10 14)
8 / 2 = 4 (left: 4 8 14)
14 + 2 = 16 (left: 8 8 16)
2 * 8 = 16 (left: 8 14 16)
8 - 2 = 6 (left: 6 8 14)
14 - 8 = 6 (left: 2 6 8)
14 / 2 = 7 (left: 7 8 8)
14 - 2 = 12 (left: 8 8 12)
Input: """

GAME24_VALUE = """Evaluate if given numbers can reach 24 (sure/likely/impossible)
10 14: sure
11 12: impossible
4 4 10: sure
4 9 11: sure
5 7 8: likely
5 6 6: likely
10 10 11: impossible
1 3 3: impossible
"""

GAME24_COT = """Use numbers and basic arithmetic operations (+ - * /) to obtain 24. Each step, you are only allowed to \
choose two of the remaining numbers to obtain a new number.
Input: 4 4 6 8
Steps:
4 + 8 = 12 (left: 4 6 12)
6 - 4 = 2 (left: 2 12)
2 * 12 = 24 (left: 24)
Answer: (6 - 4) * (4 + 8) = 24
Input: 2 9 10 12
Steps:
12 * 2 = 24 (left: 9 10 24)
10 - 9 = 1 (left: 1 24)
24 * 1 = 24 (left: 24)
Answer: (12 * 2) * (10 - 9) = 24
Input: 4 9 10 13
Steps:
13 - 10 = 3 (left: 3 4 9)
9 - 3 = 6 (left: 4 6)
4 * 6 = 24 (left: 24)
Answer: 4 * (9 - (13 - 10)) = 24
Input: 1 4 8 8
Steps:
8 / 4 = 2 (left: 1 2 8)
1 + 2 = 3 (left: 3 8)
3 * 8 = 24 (left: 24)
Answer: (1 + 8 / 4) * 8 = 24
Input: 5 5 5 9
Steps:
5 + 5 = 10 (left: 5 9 10)
10 + 5 = 15 (left: 9 15)
15 + 9 = 24 (left: 24)
Answer: ((5 + 5) + 5) + 9 = 24
Input: """

VOTE = """Given an instruction and several choices, decide which choice is most promising. Conclude in the last \
line "The best choice is {s}", where s the integer id of the choice.
"""

CREATIVE_SENTENCES = """Write a coherent passage of {n} short paragraphs. The end sentence of each paragraph must \
be: {sentences}
"""
CREATIVE_TOPIC = "Write a coherent passage of a few short paragraphs about: {topic}\n"
CREATIVE_FORMAT = """
First write a short plan, one line per paragraph. Then write the passage.

Plan:
"""

QUESTION_STEPS = """Answer the question. Think step by step, one short sentence per line, and end with a line \
"Answer: ...".
Question: {question}
"""

QUESTION_VALUE = """Judge whether the reasoning so far is correct and leads to the answer (sure/likely/impossible).
Question: {question}
Reasoning:
"""

VALUE_WORDS = ("sure", "likely", "impossible")
VALUE_MAP = {"sure": 20.0, "likely": 1.0, "impossible": 0.001}  # the paper's value_map (game24 value_outputs_unwrap)


def value_options() -> list[str]:
    """The value verdicts as scored continuations, each ending its line (no option is a prefix of another)."""
    return [f" {word}\n" for word in VALUE_WORDS]


def vote_options(n: int) -> list[str]:
    """The vote ids 1..n as scored continuations " i\n" (with the terminator, " 1" cannot count " 12")."""
    return [f" {i}\n" for i in range(1, n + 1)]
