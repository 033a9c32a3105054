"""Command-line tools: `python -m lab` (cli), the benchmark and its reference rows, Measure, the Mirostat
evaluation, EAGLE's tree-size tuning and prompt lookup's draft-length replay."""
