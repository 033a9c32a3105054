"""Command-line tools: `python -m lab` (cli), the benchmark and its reference rows, Measure, the Mirostat
evaluation and EAGLE's tree-size tuning."""
