"""The self-distillation prompt set: 336 instructions over the 8 builtin categories, written for this project.

Each category pairs a few instruction templates with its own subjects; `distill_prompts()` expands them in a
fixed order (no randomness), so the set is reproducible. The set is disjoint from the benchmark prompts
(`lab.app.builtin_prompts.BUILTIN_PROMPTS`); tests/test_distill.py checks it.
"""

from __future__ import annotations

from itertools import product

# category -> (templates, subjects); each category yields len(templates) * len(subjects) prompts (6 x 7 = 42)
_SPECS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "writing": (
        (
            "Write a short poem about {}.",
            "Write the opening paragraph of a story about {}.",
            "Write a haiku about {}.",
            "Write a short blog post introduction about {}.",
            "Describe {} in vivid detail in four sentences.",
            "Write a letter to a friend about {}.",
        ),
        (
            "an old bicycle",
            "the first snow of winter",
            "a lost umbrella",
            "a night market",
            "a quiet library",
            "a garden after rain",
            "a mountain village",
        ),
    ),
    "roleplay": (
        (
            "You are {}. Introduce yourself to a new visitor.",
            "Pretend you are {} and describe your typical day.",
            "Act as {} and give advice to a beginner.",
            "You are {}. Explain what you love most about your work.",
            "Play the role of {} answering a customer's complaint politely.",
            "As {}, tell a short story from your past.",
        ),
        (
            "a lighthouse engineer",
            "a medieval baker",
            "a robot librarian",
            "a space station cook",
            "a museum guard",
            "a mountain guide",
            "a wise old tortoise",
        ),
    ),
    "reasoning": (
        (
            "{} Explain your reasoning step by step.",
            "{} Give a short answer and then justify it.",
            "{} What assumptions did you make?",
            "Think carefully: {}",
            "{} Answer in two sentences.",
            "Puzzle: {} Explain how you solved it.",
        ),
        (
            "If it rains, the street gets wet. The street is wet. Did it rain?",
            "Sara has twice as many books as Ben. Ben has 6 books. How many do they have together?",
            "Which is heavier, a kilogram of feathers or a kilogram of iron?",
            "Five friends sit in a row. Ana is left of Bo, and Bo is left of Cy. Who is furthest left of the three?",
            "All cats in the house are black. Milo is a cat in the house. What color is Milo?",
            "A clock shows 3:15. What is the angle between the hour and minute hands?",
            "If yesterday was Monday, what day will it be in three days?",
        ),
    ),
    "math": (
        (
            "Calculate {} and show your work.",
            "What is {}? Explain each step.",
            "Solve this: {}",
            "Explain how to compute {} to a student.",
            "Find the answer to {} and check it.",
            "Work out {} using a simple method.",
        ),
        (
            "12 times 14",
            "25 percent of 360",
            "the area of a rectangle 7 cm by 9 cm",
            "the sum of the first 10 positive integers",
            "x if 5x - 4 = 21",
            "the average of 4, 8, 15 and 21",
            "the perimeter of a square with side 13",
        ),
    ),
    "coding": (
        (
            "Write a Python function that {}.",
            "Explain how to write code that {}.",
            "Write a JavaScript function that {}.",
            "Describe an algorithm that {}.",
            "Write Python code with comments that {}.",
            "What is a simple way to write a program that {}?",
        ),
        (
            "reverses a list",
            "counts the vowels in a string",
            "finds the largest number in a list",
            "checks whether a number is prime",
            "merges two sorted lists",
            "removes duplicates from a list",
            "converts Celsius to Fahrenheit",
        ),
    ),
    "extraction": (
        (
            "Extract all the numbers from this text: '{}'",
            "List the people mentioned in: '{}'",
            "Summarize this sentence in five words: '{}'",
            "What places appear in this text? '{}'",
            "Turn this into a bullet list of facts: '{}'",
            "Find the main action in: '{}'",
        ),
        (
            "Lena bought 3 apples and 2 pears at the market in Porto on Friday.",
            "The meeting with Raj and Mei moved from room 12 to room 7 at 3 pm.",
            "In 2019, Omar ran 42 km in Berlin and finished in 3 hours 40 minutes.",
            "Grandma Rosa sent 4 postcards from Rome and 1 from Naples last summer.",
            "Kofi paid 18 dollars for two tickets to the concert in Accra.",
            "The train from Vienna to Prague left at 9:10 with 230 passengers.",
            "Ines and Paulo planted 12 trees near the school in Lima.",
        ),
    ),
    "stem": (
        (
            "Explain {} in simple terms.",
            "Why does {} matter? Give an example.",
            "Describe how {} works.",
            "What are common misconceptions about {}?",
            "Explain {} to a ten-year-old.",
            "Give three facts about {}.",
        ),
        (
            "gravity",
            "the water cycle",
            "electric circuits",
            "DNA",
            "volcanoes",
            "the phases of the Moon",
            "how vaccines train the immune system",
        ),
    ),
    "humanities": (
        (
            "What was the importance of {}?",
            "Summarize {} in a short paragraph.",
            "Explain {} and its effect on society.",
            "What can we learn today from {}?",
            "Describe {} to someone who has never heard of it.",
            "Give two causes and two consequences of {}.",
        ),
        (
            "the Silk Road",
            "the invention of writing",
            "the Industrial Revolution",
            "ancient Greek theatre",
            "the Olympic Games",
            "the abolition of slavery",
            "the first public libraries",
        ),
    ),
}


def distill_prompts() -> list[tuple[str, str]]:
    """All (category, instruction) pairs, interleaved across categories in a fixed order."""
    per_category = {
        category: [template.format(subject) for subject, template in product(subjects, templates)]
        for category, (templates, subjects) in _SPECS.items()
    }
    count = max(len(items) for items in per_category.values())
    return [
        (category, items[index])
        for index in range(count)
        for category, items in per_category.items()
        if index < len(items)
    ]
