"""The lab's shared colours and layout conventions (docs/architecture.md section 8).

Covers: the provenance / status colours used by every view (accepted green, rejected red, recovered orange,
bonus blue, pruned grey, plain target tokens slate, tokens forced by a branch violet), light tints of them for token
backgrounds, the base
plotly layout (template "none", height only, `uirevision` so zoom survives streamed updates), and the helpers
that turn a token into display text (visible whitespace, HTML-escaped) and keep repeated tokens distinct in
heatmap cells. Not covered: per-figure layout details, which live with each figure.
"""

from __future__ import annotations

import html

# Strong colours: markers, lines, tree nodes, legend swatches.
STATUS_COLORS: dict[str, str] = {
    "accepted": "#2ca02c",
    "rejected": "#d62728",
    "recovered": "#ff7f0e",
    "bonus": "#1f77b4",
    "pruned": "#9e9e9e",
    "target": "#64748b",
    "forced": "#7c3aed",  # a token the viewer chose (branch from here)
}

# Light tints of the same hues: token backgrounds, where dark text must stay readable.
TOKEN_BACKGROUNDS: dict[str, str] = {
    "accepted": "#c8ecc8",
    "rejected": "#f8c6c6",
    "recovered": "#ffd9ad",
    "bonus": "#c6dcf5",
    "pruned": "#e0e0e0",
    "target": "#e2e8f0",
    "forced": "#e4d4fb",
}

DEFAULT_STATUS = "target"
TEXT_COLOR = "#1e293b"
SELECTED_OUTLINE = "#0f172a"
PROBABILITY_COLORSCALE = "Blues"
FONT_FAMILY = "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif"
UIREVISION = "decoding-lab"

ZWNJ = "\u200c"  # zero-width non-joiner: invisible, but makes equal strings differ
VISIBLE_WHITESPACE = {" ": "␣", "\n": "⏎", "\t": "⇥", "\r": "↵"}
EMPTY_TOKEN = "∅"  # a token whose text is empty (e.g. the first byte of a multi-byte character)


def status_color(status: str) -> str:
    """The strong colour of a provenance / status; unknown ones get the plain target colour."""
    return STATUS_COLORS.get(status, STATUS_COLORS[DEFAULT_STATUS])


def token_background(status: str) -> str:
    """The light background tint of a provenance / status; unknown ones get the plain target tint."""
    return TOKEN_BACKGROUNDS.get(status, TOKEN_BACKGROUNDS[DEFAULT_STATUS])


def display_token(text: str, escape: bool = True) -> str:
    """Render a token for display: whitespace made visible ('␣', '⏎', '⇥'), empty text as '∅', and the result
    HTML-escaped (plotly labels and HTML views both interpret markup) unless `escape` is False. Quotes are left
    as they are: plotly decodes &lt; &gt; &amp; but prints &quot; literally, and text nodes need no quoting
    (HTML attributes are escaped with quote=True where they are built)."""
    shown = "".join(VISIBLE_WHITESPACE.get(ch, ch) for ch in text) if text else EMPTY_TOKEN
    return html.escape(shown, quote=False) if escape else shown


def plot_text(text: str) -> str:
    """Prose for plotly text (titles, labels, hover): markup escaped, quotes kept (plotly prints &quot; as is)."""
    return html.escape(text, quote=False)


def distinct_labels(labels: list[str]) -> list[str]:
    """Make repeated labels distinct by appending one zero-width non-joiner per earlier occurrence, so plotly
    never merges equal strings (categorical axes, cell texts); the labels look unchanged."""
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        count = seen.get(label, 0)
        seen[label] = count + 1
        out.append(label + ZWNJ * count)
    return out


def base_layout(title: str, height: int, uirevision: str = UIREVISION) -> dict:
    """The layout every lab figure starts from: light template, height only (the width follows the page),
    `uirevision` so zoom and legend toggles survive streamed updates, compact margins and one font."""
    return {
        "template": "none",
        "title": {"text": title, "x": 0.01, "xanchor": "left", "font": {"size": 14}},
        "height": height,
        "autosize": True,
        "uirevision": uirevision,
        "margin": {"l": 56, "r": 24, "t": 44, "b": 44},
        "font": {"family": FONT_FAMILY, "size": 12, "color": TEXT_COLOR},
        "paper_bgcolor": "white",
        "plot_bgcolor": "white",
        "hoverlabel": {"font": {"family": FONT_FAMILY, "size": 12}},
    }
