#!/usr/bin/env bash
# Two benchmark tables (draft heads; SD vs SSD with one drafter), in one go (about 15 minutes on a quiet 2-core CPU). Run it alone: every
# number is a ratio measured within one `lab bench` run, but other processes on the machine still add noise.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/bench}
mkdir -p "$OUT"
COMMON=(--max-new-tokens 128 --dtype bfloat16)
# 1. vanilla SD (prompt lookup) and the draft-head methods against the lab's greedy, with HF's prompt lookup
# (and a profiled pass: where each strategy's time goes)
$PY -m lab bench --strategies greedy,speculative,medusa,mtpc,eagle --hf-assist prompt-lookup --profile "${COMMON[@]}" \
    | tee "$OUT/heads.txt"
# 2. SD vs SSD with the same self-drafter (first 12 layers), with HF assisted generation using that drafter
$PY -m lab bench --strategies greedy,speculative,ssd --limit 8 --hf-assist self-draft:12 \
    --params speculative.drafter=self-draft --params speculative.draft_layers=12 \
    --params ssd.drafter=self-draft --params ssd.draft_layers=12 "${COMMON[@]}" | tee "$OUT/ssd.txt"
