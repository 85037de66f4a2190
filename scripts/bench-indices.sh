#!/usr/bin/env bash
# Benchmark: building GPTDataset's document, sample and shuffle indices of a large pretraining
# dataset, mindkit (`data samples --first 1`, which builds them as `train` does) against
# megatron-core 0.15.3's GPTDataset (its C++ helpers; its cache beside the data removed before each
# run, so that it builds rather than loads them), side by side on the same
# .idx: DOCS documents of 200..MAX tokens (default 5 M documents ≈ 5.5 G tokens, an 11 GB uint16
# .bin, sparse: index building never reads tokens). Train split of one epoch at SEQ tokens.
# RUNS rounds, medians; peak RSS of each process tree (scripts/bench/measure.py).
#   scripts/bench-indices.sh
# Env: RUNS (3), DOCS (5000000), MAX (2000), SEQ (4096).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3} DOCS=${DOCS:-5000000} MAX=${MAX:-2000} SEQ=${SEQ:-4096}
venv="$(bash scripts/setup-interop-venv.sh)"
py="$venv/bin/python"
cargo build --release --bin mindkit >&2
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$py" scripts/bench/big_idx.py "$work/big" "$DOCS" 200 "$MAX"
# one epoch of the train split (969/1000 of the documents), as Megatron sizes it from --train-samples
samples=$("$py" -c "import numpy as np; n=$DOCS; l=np.random.default_rng(0).integers(200,$MAX+1,size=n,dtype=np.int32); \
k=int(round(n*0.969)); print((int(l[:k].astype(np.int64).sum())-1)//$SEQ)")
for run in $(seq "$RUNS"); do
  echo "round $run/$RUNS" >&2
  "$py" scripts/bench/measure.py "$work/mindkit.$run.json" -- target/release/mindkit data samples \
    --data-path "$work/big" --seq-length "$SEQ" --samples "$samples" --first 1
  rm -rf "$work/big/cache"  # where GPTDataset caches without --data-cache-path
  "$py" scripts/bench/measure.py "$work/megatron.$run.json" -- \
    "$py" scripts/bench/gpt_indices.py "$work/big" "$SEQ" "$samples"
done
"$py" - "$work" "$RUNS" <<'PY'
import json, statistics, sys
work, runs = sys.argv[1], int(sys.argv[2])
rows = {}
for tool in ("megatron", "mindkit"):
    m = [json.load(open(f"{work}/{tool}.{r}.json")) for r in range(1, runs + 1)]
    wall = statistics.median(x["wall_s"] for x in m)
    # megatron-core's own build time, without Python's and torch's start-up
    build = [float(x["stderr_tail"].rsplit(" in ", 1)[1].split()[0]) for x in m] if tool == "megatron" else []
    rows[tool] = (wall, statistics.median(build) if build else wall, statistics.median(x["peak_rss_mb"] for x in m))
print("| | wall s | building the indices s | peak RSS |\n|---|---:|---:|---:|")
for tool, (wall, build, rss) in rows.items():
    print(f"| {tool} | {wall:.2f} | {build:.2f} | {rss:.0f} MB |")
print(f"mindkit: {rows['megatron'][0] / rows['mindkit'][0]:.2f}x megatron-core's wall time, "
      f"{rows['megatron'][1] / rows['mindkit'][1]:.2f}x its build alone")
PY
