"""The Learn tab's texts: per strategy an explanation, its formula (LaTeX), the paper and what to watch, in English
and Chinese (docs/learn/en.toml, docs/learn/zh.toml).

Covered: `load_entries(lang)` (the Chinese file holds translated prose; formula, url and any missing field fall
back to English), `learn_markdown(name, lang)` (the rendered entry, the formula in $$ ... $$ for gr.Markdown's
latex_delimiters) and `matrix_cells(name, lang)` (problem solved, core operation, when to use it: the Measure
tab's selection matrix). Entries exist for the 12 planned strategies; the app lists only registered ones, so
a strategy that lands later appears with its text at once. A registered strategy without an entry gets its
registry summary and paper. `models_markdown()` is docs/models.md (strategies by model family, head formats),
shown in English only. Not covered: other languages (add docs/learn/<lang>.toml and a LANGUAGES entry).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import tomllib

LEARN_DIR = Path(__file__).resolve().parents[2] / "docs" / "learn"
MODELS_DOC = LEARN_DIR.parent / "models.md"
LANGUAGES = {"English": "en", "中文": "zh"}
FIELDS = ("title", "idea", "formula", "symbols", "paper", "url", "watch", "problem", "operation", "when")
HEADINGS = {
    "en": {
        "formula": "Formula",
        "symbols": "Symbols",
        "paper": "Paper",
        "watch": "What to watch in its view",
        "problem": "Problem it solves",
        "operation": "Core operation",
        "when": "When to use it",
    },
    "zh": {
        "formula": "公式",
        "symbols": "符号",
        "paper": "论文",
        "watch": "在可视化中看什么",
        "problem": "解决的问题",
        "operation": "核心操作",
        "when": "何时使用",
    },
}


def _code(lang: str) -> str:
    """Accept a language label ("English", "中文") or code ("en", "zh"); unknown ones read as English."""
    code = LANGUAGES.get(lang, lang)
    return code if code in HEADINGS else "en"


@cache
def load_entries(lang: str = "en") -> dict[str, dict[str, str]]:
    """Every entry of a language, with missing fields filled from English."""
    english = tomllib.loads((LEARN_DIR / "en.toml").read_text(encoding="utf-8"))
    code = _code(lang)
    if code == "en":
        return english
    local = tomllib.loads((LEARN_DIR / f"{code}.toml").read_text(encoding="utf-8"))
    return {name: {**entry, **local.get(name, {})} for name, entry in english.items()}


def entry(name: str, lang: str = "en", fallback: tuple[str, str] | None = None) -> dict[str, str] | None:
    """The entry of a strategy; `fallback` = (summary, paper) from the registry when there is no entry."""
    found = load_entries(_code(lang)).get(name)
    if found is None and fallback is not None:
        summary, paper = fallback
        return {"title": name, "idea": summary, "paper": paper}
    return found


def learn_markdown(name: str, lang: str = "en", fallback: tuple[str, str] | None = None) -> str:
    """The entry as markdown: title, idea, formula (display LaTeX), symbols, paper (linked), what to watch."""
    found = entry(name, lang, fallback)
    if found is None:
        return f"No text for {name!r} yet."
    heads = HEADINGS[_code(lang)]
    parts = [f"### {found.get('title', name)}", found.get("idea", "")]
    if found.get("formula"):
        parts.append(f"**{heads['formula']}**\n\n$$ {found['formula']} $$")
    if found.get("symbols"):
        parts.append(f"*{heads['symbols']}:* {found['symbols']}")
    if found.get("paper"):
        paper = f"[{found['paper']}]({found['url']})" if found.get("url") else found["paper"]
        parts.append(f"**{heads['paper']}:** {paper}")
    if found.get("watch"):
        parts.append(f"**{heads['watch']}:** {found['watch']}")
    return "\n\n".join(part for part in parts if part)


def matrix_cells(name: str, lang: str = "en") -> tuple[str, str, str]:
    """(problem solved, core operation, when to use it) for the selection matrix; empty strings if unknown."""
    found = load_entries(_code(lang)).get(name, {})
    return found.get("problem", ""), found.get("operation", ""), found.get("when", "")


def matrix_headings(lang: str = "en") -> tuple[str, str, str]:
    heads = HEADINGS[_code(lang)]
    return heads["problem"], heads["operation"], heads["when"]


@cache
def models_markdown() -> str:
    """docs/models.md: which strategies work on which model families, and the published head formats."""
    return MODELS_DOC.read_text(encoding="utf-8") if MODELS_DOC.is_file() else "docs/models.md is missing."
