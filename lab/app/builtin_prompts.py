"""Builtin prompts for demos, tests and the benchmark: 24 prompts over 8 categories, written for this project.

Categories follow common chat-benchmark groupings (writing, roleplay, reasoning, math, coding, extraction,
STEM, humanities). `load_prompts("builtin")` returns their texts; a file path gives one prompt per line, or a
JSON list of strings. These prompts are kept disjoint from any training data the lab generates.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lab.app.validation import validate_prompt
from lab.params import InputError

MAX_PROMPT_FILE_BYTES = 2_000_000


@dataclass(frozen=True)
class Prompt:
    category: str
    text: str


BUILTIN_PROMPTS: list[Prompt] = [
    Prompt("writing", "Write a short poem about a lighthouse keeper who waits for a ship that never comes."),
    Prompt("writing", "Write a friendly email inviting my neighbours to a garden party next Saturday."),
    Prompt("writing", "Describe a rainy morning in a busy city in three sentences."),
    Prompt("roleplay", "You are a tour guide in ancient Rome. Greet a group of visitors and describe the Forum."),
    Prompt("roleplay", "Pretend you are a cat explaining to a dog why naps matter."),
    Prompt("roleplay", "Act as a ship's captain giving a calm speech to passengers during a storm."),
    Prompt("reasoning", "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies? Explain."),
    Prompt("reasoning", "Tom is taller than Ana, and Ana is taller than Li. Who is the shortest, and why?"),
    Prompt("reasoning", "A farmer has a fox, a goose and a bag of grain. How can he cross the river safely?"),
    Prompt("math", "What is 15 percent of 240? Show the steps."),
    Prompt("math", "Solve for x: 3x + 7 = 22. Explain each step."),
    Prompt("math", "A train travels 180 km in 2 hours. What is its average speed in km per hour?"),
    Prompt("coding", "Write a Python function that returns the factorial of a number."),
    Prompt("coding", "Explain what a for loop does in Python, with a short example."),
    Prompt("coding", "Write a Python function that checks whether a string is a palindrome."),
    Prompt("extraction", "Extract the names and ages: 'Maria is 34, her brother Jon is 29 and their aunt Eva is 61.'"),
    Prompt("extraction", "List the cities mentioned: 'We flew from Oslo to Madrid, then took a train to Lisbon.'"),
    Prompt("extraction", "What is the date and place of the meeting in: 'See you on 12 March in room 4B at noon.'"),
    Prompt("stem", "Why is the sky blue? Explain it simply."),
    Prompt("stem", "What is photosynthesis, and why is it important for life on Earth?"),
    Prompt("stem", "Explain the difference between speed and velocity."),
    Prompt("humanities", "Why did the printing press change Europe? Give two reasons."),
    Prompt("humanities", "What is the main idea of democracy, in a few sentences?"),
    Prompt("humanities", "Name three famous painters of the Renaissance and one work by each."),
]

CATEGORIES = tuple(dict.fromkeys(p.category for p in BUILTIN_PROMPTS))


def load_prompts(source: str = "builtin") -> list[str]:
    """Prompt texts from "builtin", a text file (one per line) or a JSON file holding a list of strings."""
    if source == "builtin":
        return [p.text for p in BUILTIN_PROMPTS]
    path = Path(source)
    if not path.is_file():
        raise InputError(f"Prompt file {source!r} does not exist; use 'builtin' or a path.")
    if path.stat().st_size > MAX_PROMPT_FILE_BYTES:
        raise InputError(f"Prompt file {source!r} is larger than {MAX_PROMPT_FILE_BYTES} bytes.")
    text = path.read_text(encoding="utf-8", errors="replace")
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except ValueError as error:
            raise InputError(f"Prompt file {source!r} is not valid JSON: {error}") from None
        if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
            raise InputError(f"Prompt file {source!r} must hold a JSON list of strings.")
    else:
        items = [line for line in text.splitlines() if line.strip()]
    if not items:
        raise InputError(f"Prompt file {source!r} holds no prompts.")
    return [validate_prompt(item) for item in items]
