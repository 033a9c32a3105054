"""Recursive Language Models (Zhang, Kraska, Khattab 2025): the sandboxed REPL, the constrained action grammar,
the synthetic long-context tasks and the evaluation behind `python -m lab eval rlm`."""
