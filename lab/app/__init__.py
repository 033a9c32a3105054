"""Gradio-free services behind the app's tabs: running a strategy into a trace (runner), input validation, shared
runs and pacing for a classroom, branching, history, replay, compare, Learn pages, presets and builtin prompts."""
