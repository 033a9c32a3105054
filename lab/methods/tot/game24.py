"""Game of 24 (Yao et al. 2023, Sec. 4.1): states, legal moves, the exact solver and the answer checker.

A state is the multiset of numbers still left (exact `Fraction`s, sorted). A move combines two of them with
+ - * / into one; its text is the paper's thought line "a op b = c (left: x y z)" with the numbers left in
ascending order. The legal moves of a state are canonical, so that one state change has one spelling:
+ and * are written larger operand first, - only as larger minus smaller (results are never negative), / in
both orders (a divisor of 0 is illegal). Results may be fractions ("7/3"); a few puzzles need them.
Dropping negative intermediates loses no solution: a negative sub-result can always be replaced by its
absolute value with the parent operation flipped (tested: the solver finds the known 1362 solvable hands
among the 1820 multisets of 1..13, and agrees with an unrestricted brute force).
`solve` is exact (depth-first over legal moves, memoized on the sorted state). `check_expression` verifies a
free-text answer ("(13 - 9) * (10 - 4) = 24") with an AST walk: only + - * / on integer literals, every puzzle
number used exactly once, value exactly 24. Not covered: targets other than 24 (TARGET is a module constant),
exponentiation, concatenation of digits.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from pathlib import Path

from lab.params import InputError

TARGET = Fraction(24)
PUZZLES_FILE = Path(__file__).with_name("puzzles.json")
MIN_NUMBERS, MAX_NUMBERS, MAX_VALUE = 2, 6, 1000
MAX_EXPRESSION_CHARS = 200


def fmt(x: Fraction) -> str:
    """A number as the thought lines write it: "4", "7/3"."""
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def state_text(numbers: tuple[Fraction, ...]) -> str:
    return " ".join(fmt(x) for x in numbers)


@dataclass(frozen=True)
class Move:
    """One thought: `a op b = result`, leaving `left` (sorted, result included)."""

    a: Fraction
    op: str
    b: Fraction
    result: Fraction
    left: tuple[Fraction, ...]

    @property
    def text(self) -> str:
        return f"{fmt(self.a)} {self.op} {fmt(self.b)} = {fmt(self.result)} (left: {state_text(self.left)})"


def _combinations(x: Fraction, y: Fraction) -> list[tuple[Fraction, str, Fraction, Fraction]]:
    """The canonical (a, op, b, result) of two numbers: larger first for + * -, both orders for /."""
    hi, lo = max(x, y), min(x, y)
    found = [(hi, "+", lo, hi + lo), (hi, "-", lo, hi - lo), (hi, "*", lo, hi * lo)]
    if lo != 0:
        found.append((hi, "/", lo, hi / lo))
    if hi != 0 and hi != lo:
        found.append((lo, "/", hi, lo / hi))
    return found


def legal_moves(numbers: tuple[Fraction, ...]) -> list[Move]:
    """Every legal move of a state, one per distinct thought text, in a fixed order (pairs, then operations)."""
    moves: dict[str, Move] = {}
    for i in range(len(numbers)):
        for j in range(i + 1, len(numbers)):
            rest = numbers[:i] + numbers[i + 1 : j] + numbers[j + 1 :]
            for a, op, b, result in _combinations(numbers[i], numbers[j]):
                move = Move(a, op, b, result, tuple(sorted((*rest, result))))
                moves.setdefault(move.text, move)
    return list(moves.values())


@lru_cache(maxsize=200_000)
def _solve(numbers: tuple[Fraction, ...]) -> tuple[Move, ...] | None:
    if len(numbers) == 1:
        return () if numbers[0] == TARGET else None
    for move in legal_moves(numbers):
        rest = _solve(move.left)
        if rest is not None:
            return (move, *rest)
    return None


def as_state(numbers: list[int] | tuple[Fraction, ...]) -> tuple[Fraction, ...]:
    return tuple(sorted(Fraction(x) for x in numbers))


def solve(numbers: list[int] | tuple[Fraction, ...]) -> list[Move] | None:
    """A sequence of legal moves reaching 24 from `numbers`, or None when there is none (exact)."""
    found = _solve(as_state(numbers))
    return None if found is None else list(found)


def solvable(numbers: list[int] | tuple[Fraction, ...]) -> bool:
    return _solve(as_state(numbers)) is not None


def expression(start: tuple[Fraction, ...], moves: list[Move]) -> str:
    """The single expression a move sequence spells, e.g. "(13 - 9) * (10 - 4)" (moves must be legal in turn)."""
    pool: list[tuple[Fraction, str]] = [(x, fmt(x)) for x in start]
    for move in moves:
        left = _take(pool, move.a)
        right = _take(pool, move.b)
        pool.append((move.result, f"({left} {move.op} {right})"))
    if len(pool) != 1:
        raise ValueError("the moves do not reduce the numbers to one")
    text = pool[0][1]
    return text[1:-1] if text.startswith("(") and text.endswith(")") else text


def _take(pool: list[tuple[Fraction, str]], value: Fraction) -> str:
    for index, (number, text) in enumerate(pool):
        if number == value:
            del pool[index]
            return text
    raise ValueError(f"{fmt(value)} is not among the numbers left")


def parse_puzzle(text: str) -> list[int]:
    """The numbers of a puzzle typed as "4 9 10 13" (commas allowed); InputError otherwise."""
    tokens = re.findall(r"-?\d+(?:\.\d+)?", text)
    words = re.sub(r"[-\d.,\s]", "", text)
    if words or not MIN_NUMBERS <= len(tokens) <= MAX_NUMBERS or any(not t.isdigit() for t in tokens):
        raise InputError(
            f"Game of 24 needs {MIN_NUMBERS}-{MAX_NUMBERS} whole numbers separated by spaces, such as '4 9 10 13'."
        )
    numbers = [int(t) for t in tokens]
    if any(n > MAX_VALUE for n in numbers):
        raise InputError(f"Game of 24 numbers must be between 0 and {MAX_VALUE}.")
    return numbers


def _value(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        left, right = _value(node.left, used), _value(node.right, used)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if right == 0:
            raise ZeroDivisionError
        return left / right
    raise ValueError("only + - * / on whole numbers are allowed")


def check_expression(text: str, numbers: list[int]) -> bool:
    """True iff `text` ("(13 - 9) * (10 - 4)", optionally followed by "= 24") uses every number of the puzzle
    exactly once with + - * / and evaluates to exactly 24."""
    left = text.split("=")[0].replace("×", "*").replace("÷", "/").strip()
    if not left or len(left) > MAX_EXPRESSION_CHARS:
        return False
    used: list[int] = []
    try:
        value = _value(ast.parse(left, mode="eval").body, used)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return False
    return value == TARGET and sorted(used) == sorted(numbers)


def load_puzzles(path: Path = PUZZLES_FILE) -> list[list[int]]:
    """The project's fixed evaluation set: 20 solvable four-number puzzles."""
    data = json.loads(path.read_text(encoding="utf-8"))
    return [list(map(int, item["numbers"])) for item in data["puzzles"]]
