"""The Learn tab: per registered strategy, its explanation, formula (LaTeX), paper and what to watch in its view,
in English or Chinese (`lab.app.learn`; the language radio also sets the Measure tab's selection matrix)."""

from __future__ import annotations

import gradio as gr

from lab.app import learn
from strategies import REGISTRY
from ui.common import LATEX, LIGHT, strategy_choices


def learn_text(name: str, language: str) -> str:
    strategy = REGISTRY.get(name)
    fallback = (strategy.summary, strategy.paper) if strategy else None
    return learn.learn_markdown(name, learn.LANGUAGES.get(language, "en"), fallback)


def build_learn_tab() -> gr.Radio:
    """Returns the language radio (the Measure tab reads it)."""
    with gr.Row():
        language = gr.Radio(list(learn.LANGUAGES), value="English", label="Language / 语言", elem_id="learn-language")
        strategy = gr.Dropdown(strategy_choices(), value="greedy", label="Strategy", elem_id="learn-strategy")
    text = gr.Markdown(learn_text("greedy", "English"), latex_delimiters=LATEX, elem_id="learn-text")
    gr.on([language.change, strategy.change], learn_text, [strategy, language], [text], **LIGHT)
    with gr.Accordion("Which strategies work on which models (docs/models.md)", open=False):
        gr.Markdown(learn.models_markdown(), elem_id="learn-models")
    return language
