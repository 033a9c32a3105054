"""The compare view's output diff: each run's text against the first run's, as inline HTML.

Covers: `diff_html(base_name, diffs)` where `diffs` maps a run's name to its `lab.app.compare` diff blocks (any
objects with op, a_text, b_text): equal text plain, text only in the first run struck through on red, text
only in the other run on green. All text is HTML-escaped; styles are inline. Not covered: computing the diff
(lab.app.compare does, over token ids).
"""

from __future__ import annotations

import html

from visualizers.style import TEXT_COLOR, token_background

_DELETED = f"background: {token_background('rejected')}; text-decoration: line-through;"
_INSERTED = f"background: {token_background('accepted')};"
_BOX = (
    f"font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 13px; color: {TEXT_COLOR};"
    " white-space: pre-wrap; word-break: break-word; line-height: 1.7; margin: 0.2em 0 0.8em 0;"
)


def _escape(text: str) -> str:
    return html.escape(text, quote=False)


def _blocks_html(blocks: list) -> str:
    parts = []
    for block in blocks:
        if block.op == "equal":
            parts.append(_escape(block.a_text))
            continue
        if block.a_text:
            parts.append(f'<span class="dl-diff-del" style="{_DELETED}">{_escape(block.a_text)}</span>')
        if block.b_text:
            parts.append(f'<span class="dl-diff-ins" style="{_INSERTED}">{_escape(block.b_text)}</span>')
    return "".join(parts)


def diff_html(base_name: str, diffs: dict[str, list]) -> str:
    """One section per compared run: its output against `base_name`'s (identical runs say so)."""
    if not diffs:
        return '<p class="dl-placeholder" style="color: #64748b; font-style: italic;">Run two or more strategies.</p>'
    sections = []
    for name, blocks in diffs.items():
        same = all(block.op == "equal" for block in blocks)
        verdict = "identical output" if same else "differences marked (struck: only in the first run; green: only here)"
        title = f"<b>{_escape(name)}</b> vs <b>{_escape(base_name)}</b>: {verdict}"
        sections.append(
            f'<div class="dl-diff"><div>{title}</div><div style="{_BOX}">{_blocks_html(blocks)}</div></div>'
        )
    return "".join(sections)
