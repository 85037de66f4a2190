#!/usr/bin/env bash
# Benchmark: wall time of 5-shot MMLU, mindkit against lm-evaluation-harness (HF backend, fp32),
# side by side, same threads, on the real SmolLM2-135M, the first LIMIT val questions of each of
# the 57 subjects in $MINDKIT_TESTDATA/mmlu; both projected to the full test split (14,042
# questions) from their seconds per question (model loading included, so the projection errs high).
#   MINDKIT_TESTDATA=../shared/data scripts/bench-mmlu.sh
# Env: LIMIT (2), THREADS (2).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MINDKIT_TESTDATA:?set MINDKIT_TESTDATA to the shared data directory}"
LIMIT=${LIMIT:-2} THREADS=${THREADS:-2}
venv="$(bash scripts/setup-interop-venv.sh)"
py="$venv/bin/python"
assets="$(bash scripts/fetch-test-assets.sh)"
cargo build --release --bin mindkit >&2
smol="$(cd tests/interop && "$py" -c 'import smollm2, sys; print(smollm2.build(sys.argv[1], sys.argv[2]))' \
  "$assets/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$assets/smollm2/hf")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
harness="$(OMP_NUM_THREADS=$THREADS "$py" scripts/bench/mmlu_harness.py "$smol" "$MINDKIT_TESTDATA" \
  "$work" "$LIMIT" "$THREADS" 2>/dev/null | tail -n 1)"
start=$EPOCHREALTIME
RAYON_NUM_THREADS=$THREADS target/release/mindkit eval --model "$smol" --task mmlu --data "$work/mmlu" \
  --limit "$LIMIT" --output "$work/mindkit.json" --quiet > /dev/null
end=$EPOCHREALTIME
"$py" - "$harness" "$start" "$end" "$work/mindkit.json" <<'PY'
import json, sys
h = json.loads(sys.argv[1]); secs = float(sys.argv[3]) - float(sys.argv[2])
m = json.load(open(sys.argv[4]))["results"]["mmlu"]
docs = m["sample_len"]
assert docs == h["docs"], (docs, h["docs"])
full = 14042
print(f"5-shot MMLU, {docs} questions (val, the first --limit of each subject), SmolLM2-135M fp32:")
for name, s, acc in (("lm-evaluation-harness", h["seconds"], h["acc"]), ("mindkit", secs, m["acc,none"])):
    print(f"  {name:22} {s:7.1f} s  {docs / s:5.2f} q/s  acc {acc:.4f}  "
          f"projected full test: {s / docs * full / 3600:.1f} h")
print(f"  mindkit is {h['seconds'] / secs:.2f}x faster")
PY
