"""Synthetic long-context tasks with known answers for RLM (needle retrieval and OOLONG-like aggregation).

A document is a log of short lines ("Log 01234: the convoy from Oslo reached Lima after the storm.") of about
`tokens` tokens (estimated at CHARS_PER_TOKEN characters a token; the run measures the real count), generated
from `seed` alone (a private `random.Random(seed)`, so the same seed gives the same document everywhere).
Kinds:
- needle: one line "The secret code of <name> is <5 digits>." plus three distractor codes of other people;
  question "What is the secret code of <name>?", answer the digits (needle-in-a-haystack retrieval).
- count: ticket lines "Ticket 0412 from Oslo: status urgent." among the logs; question "How many tickets have
  status <label>?", answer the count (counting over the whole document, OOLONG-style aggregation).
- sum: order lines "Order 5120: <customer> bought 17 units." ; question "How many units did <customer> buy in
  total?", answer the sum (aggregation that needs every matching line).
- tally: shipment lines "Shipment 0412: seven crates of pears arrived." (quantities written as words, fruits
  varied) spread evenly through every part of the document; question "How many crates of pears arrived in
  total?", answer the sum over all pear lines. Grep finds the lines but no helper reads the words: the answer
  needs a sub-call on every chunk and a combine step (the recursion-necessary family; run it at 100k+ tokens).
Status labels, customer names and fruits appear only in their own lines, so the answers are exact.
Not covered: OOLONG's semantic labels (the labels here are written out), multi-hop questions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("needle", "count", "sum")  # the eval's standard families
ALL_KINDS = (*KINDS, "tally")
CHARS_PER_TOKEN = 3.0  # measured on these logs with the SmolLM2 tokenizer (digits are single tokens)
MIN_TOKENS, MAX_TOKENS = 1_000, 500_000

CITIES = ("Oslo", "Lima", "Quito", "Perth", "Accra", "Hanoi", "Turin", "Dakar", "Porto", "Riga", "Cusco", "Sapporo")
VEHICLES = ("convoy", "ferry", "train", "caravan", "barge", "courier", "truck", "glider")
EVENTS = ("the storm", "a long delay", "the inspection", "sunrise", "the holiday", "a detour", "the night shift")
VERBS = ("reached", "left for", "turned back toward", "waited near", "was rerouted to", "passed through")
FIRST = ("Mira", "Tomas", "Lena", "Ravi", "Ines", "Kofi", "Yuki", "Omar", "Sana", "Pavel", "Nora", "Diego")
LAST = ("Falcon", "Brook", "Hale", "Moreno", "Okafor", "Lindqvist", "Tanaka", "Rossi", "Novak", "Quinn", "Adler")
LABELS = ("urgent", "pending", "resolved", "escalated", "archived")
FRUITS = ("pears", "plums", "figs", "limes")
NUMBER_WORDS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


@dataclass(frozen=True)
class Task:
    kind: str
    seed: int
    question: str
    answer: str
    context: str
    facts: int  # lines that carry the answer (needles, matching tickets or orders)


def _log_line(rng: random.Random, index: int) -> str:
    return (
        f"Log {index:05d}: the {rng.choice(VEHICLES)} from {rng.choice(CITIES)} {rng.choice(VERBS)} "
        f"{rng.choice(CITIES)} after {rng.choice(EVENTS)}."
    )


def _people(rng: random.Random, n: int) -> list[str]:
    names = [f"{first} {last}" for first in FIRST for last in LAST]
    return rng.sample(names, n)


def _special_lines(kind: str, rng: random.Random, n_lines: int) -> tuple[list[str], str, str, int]:
    """The task's own lines, its question and its answer."""
    if kind == "needle":
        people = _people(rng, 4)
        codes = [rng.randrange(10_000, 100_000) for _ in people]
        lines = [f"The secret code of {p} is {c}." for p, c in zip(people, codes, strict=True)]
        return lines, f"What is the secret code of {people[0]}?", str(codes[0]), 1
    if kind == "count":
        n_tickets = max(6, n_lines // 40)
        labels = [rng.choice(LABELS) for _ in range(n_tickets)]
        target = rng.choice(LABELS)
        if target not in labels:
            labels[0] = target
        lines = [f"Ticket {rng.randrange(1000, 10000)} from {rng.choice(CITIES)}: status {lab}." for lab in labels]
        return lines, f"How many tickets have status {target}?", str(labels.count(target)), labels.count(target)
    if kind == "sum":
        customers = _people(rng, 6)
        n_orders = max(8, n_lines // 50)
        buyers = [rng.choice(customers) for _ in range(n_orders)]
        target = buyers[0]
        qty = [rng.randrange(1, 50) for _ in buyers]
        lines = [f"Order {rng.randrange(1000, 10000)}: {b} bought {q} units." for b, q in zip(buyers, qty, strict=True)]
        total = sum(q for b, q in zip(buyers, qty, strict=True) if b == target)
        return lines, f"How many units did {target} buy in total?", str(total), buyers.count(target)
    if kind == "tally":
        n_shipments = max(8, n_lines // 30)
        fruits = [rng.choice(FRUITS) for _ in range(n_shipments)]
        fruits[0] = "pears"
        qty = [rng.randrange(1, 10) for _ in fruits]
        lines = [
            f"Shipment {rng.randrange(1000, 10000)}: {NUMBER_WORDS[q - 1]} crate{'s' * (q > 1)} of {f} arrived."
            for f, q in zip(fruits, qty, strict=True)
        ]
        total = sum(q for f, q in zip(fruits, qty, strict=True) if f == "pears")
        return lines, "How many crates of pears arrived in total?", str(total), fruits.count("pears")
    raise ValueError(f"unknown task kind {kind!r}; choose one of {', '.join(ALL_KINDS)}")


def make_task(kind: str, tokens: int, seed: int) -> Task:
    """A document of about `tokens` tokens with the task's lines scattered through it (deterministic in seed)."""
    if not MIN_TOKENS <= tokens <= MAX_TOKENS:
        raise ValueError(f"tokens must be in [{MIN_TOKENS}, {MAX_TOKENS}], got {tokens}")
    rng = random.Random(f"{kind}-{seed}")
    target_chars = int(tokens * CHARS_PER_TOKEN)
    n_lines = max(20, target_chars // 62)
    special, question, answer, facts = _special_lines(kind, rng, n_lines)
    lines = [_log_line(rng, i) for i in range(n_lines)]
    if kind == "tally":  # evenly spread: every stretch of the document holds some shipments
        step = len(lines) / len(special)
        for i, line in enumerate(reversed(special)):
            lines.insert(max(1, int((len(special) - 1 - i) * step + rng.random() * step)), line)
    else:
        for line in special:
            lines.insert(rng.randrange(1, len(lines)), line)  # never first: the prefix the root sees is plain logs
    return Task(kind, seed, question, answer, "\n".join(lines) + "\n", facts)
