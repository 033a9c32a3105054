#!/usr/bin/env bash
# Record the example traces the app's Replay tab offers (examples/traces/*.json), one short real run each.
# Rerun after adding a strategy: add a line below. Usage: bash scripts/record_examples.sh [NAME ...]
# Every run is seeded (--seed 0), so a rerun on the same machine and dtype records the same tokens.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=examples/traces
TOKENS=${TOKENS:-48}
mkdir -p "$OUT"

# name | prompt | extra --set options
# rlm: the shipped examples/traces/rlm.json is the tally run (100k tokens, 35 sub-calls) that
# `python -m lab eval rlm --limit 6 --sizes 20000 --tally 1 --traces DIR` saved; its line records the same task,
# with TOKENS tokens per call where the eval used 128
EXAMPLES=(
  "greedy|Why is the sky blue? Explain it simply.|"
  "sample|Write a short poem about a lighthouse keeper who waits for a ship that never comes.|--set temperature=0.8"
  "dola|Name three famous painters of the Renaissance and one work by each.|"
  "cfg|Describe a rainy morning in a busy city in three sentences.|--set gamma=1.5"
  "mirostat|Pretend you are a cat explaining to a dog why naps matter.|--set tau=3.0"
  "speculative|Extract the names and ages: 'Maria is 34, her brother Jon is 29 and their aunt Eva is 61.'|"
  "ssd|Write a Python function that checks whether a string is a palindrome.|"
  "medusa|Explain the difference between speed and velocity.|"
  "mtpc|What is photosynthesis, and why is it important for life on Earth?|"
  "eagle|Solve for x: 3x + 7 = 22. Explain each step.|"
  "tot|4 9 10 13|--set value=solver"
  "rlm|What is asked in the task?|--set task=tally --set context_tokens=100000 --set max_sub_calls=64 --set sub_window=4096 --set max_total_tokens=600000"
)

registered=$("$PY" -c "from strategies import REGISTRY; print(' '.join(REGISTRY))")
for entry in "${EXAMPLES[@]}"; do
  IFS='|' read -r name prompt extra <<<"$entry"
  if [ "$#" -gt 0 ] && [[ " $* " != *" $name "* ]]; then continue; fi
  if [[ " $registered " != *" $name "* ]]; then echo "skip $name (not registered)"; continue; fi
  echo "recording $name"
  # shellcheck disable=SC2086
  "$PY" -m lab run --strategy "$name" --prompt "$prompt" --seed 0 --max-new-tokens "$TOKENS" \
    --trace "$OUT/$name.json" $extra >/dev/null
done
ls -la "$OUT"
