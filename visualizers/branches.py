"""The small tree of runs that "branch from here" builds: the original run and the branches taken from its tokens.

Covers `run_tree_html(nodes)`: nested lists, one item per run (the original first), each branch labelled with the
token it replaced and the token it forced, and the start of its text. A node is a dict with "id", "parent"
(None for the original), "label", and for a branch "at_token", "replaced" and "forced". All text is HTML-escaped.
Imports the standard library and visualizers.style only.
"""

from __future__ import annotations

import html

from visualizers.style import TEXT_COLOR, display_token

PREVIEW_CHARS = 60
FORCED_COLOR = "#7c3aed"


def _item(node: dict) -> str:
    label = html.escape(node.get("label", "")[:PREVIEW_CHARS])
    if node.get("parent") is None:
        return f'<span class="dl-run-root"><b>original run</b>: {label}</span>'
    replaced = display_token(node.get("replaced", ""))
    forced = display_token(node.get("forced", ""))
    where = f"token {node.get('at_token', 0) + 1}: <s>{replaced}</s> → <b style='color: {FORCED_COLOR}'>{forced}</b>"
    return f'<span class="dl-run-branch">branch at {where}: {label}</span>'


def _children(nodes: list[dict], parent: str | None) -> str:
    items = [n for n in nodes if n.get("parent") == parent]
    if not items:
        return ""
    inner = "".join(f"<li>{_item(n)}{_children(nodes, n['id'])}</li>" for n in items)
    return f'<ul style="margin: 0.2em 0 0.2em 1.2em; padding: 0;">{inner}</ul>'


def run_tree_html(nodes: list[dict]) -> str:
    """The runs as a nested list (original run(s) at the top level); a hint when there is no run yet."""
    if not nodes:
        return '<p style="color: #64748b; font-style: italic;">No branches yet.</p>'
    style = f"font-family: system-ui, sans-serif; font-size: 13px; color: {TEXT_COLOR};"
    ids = {n["id"] for n in nodes}
    top = [n for n in nodes if n.get("parent") not in ids]
    body = "".join(f"<li>{_item(n)}{_children(nodes, n['id'])}</li>" for n in top)
    return f'<div class="dl-run-tree" style="{style}"><ul style="margin: 0; padding-left: 1em;">{body}</ul></div>'
