#!/usr/bin/env bash
# Benchmark: mindkit preprocess vs Megatron-LM's tools/preprocess_data.py vs the HF `tokenizers`
# library alone (the ceiling), side by side, same corpus (KJV as jsonl, one document per chapter,
# ~50 MB), same LLaMA-2 tokenizer, same worker count, RUNS rounds interleaved; prints medians.
#
#   MEGATRON_LM=/path/to/Megatron-LM scripts/bench-preprocess.sh
#
# MEGATRON_LM: a Megatron-LM checkout (git clone -b core_v0.15.3 https://github.com/NVIDIA/Megatron-LM);
#   it runs in the interop venv (scripts/setup-interop-venv.sh). Both run in the mode of core 0.15.3's
#   default tokenizer (plain ids, no BOS; mindkit --no-special-tokens) and must write identical bytes;
#   mindkit's default mode (BOS added, as Megatron HEAD) is timed as a further row.
# Corpus: Debian's bible-kjv packages (apt-get download; cached under ~/.cache/mindkit/bench).
# Env: RUNS (3), SIZE_MB (50), WORKERS (2), BIG_GB (0: set e.g. 10 to also measure mindkit's
#   peak memory on a BIG_GB input, built by repeating the corpus; needs ~1.6x that much disk).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (see the header of this script)}"
RUNS=${RUNS:-3} SIZE_MB=${SIZE_MB:-50} WORKERS=${WORKERS:-2} BIG_GB=${BIG_GB:-0}
cache="${MINDKIT_CACHE:-$HOME/.cache/mindkit}/bench"
mkdir -p "$cache"
assets="$(bash scripts/fetch-test-assets.sh)"
venv="$(bash scripts/setup-interop-venv.sh)"
py="$venv/bin/python"
cargo build --release --bin mindkit >&2
bin="$PWD/target/release/mindkit"
tok="$assets/llama2"

if [[ ! -s "$cache/kjv.txt" ]]; then
  deb="$(mktemp -d)"
  (cd "$deb" && apt-get download bible-kjv bible-kjv-text >&2 && for d in *.deb; do dpkg-deb -x "$d" root; done)
  "$deb/root/usr/bin/bible" -p "$deb/root/usr/lib" -f -m 8000000 "gen1:1-rev22:21" >"$cache/kjv.txt.part"
  mv "$cache/kjv.txt.part" "$cache/kjv.txt"
  rm -rf "$deb"
fi
corpus="$cache/kjv-${SIZE_MB}mb.jsonl"
[[ -s "$corpus" ]] || "$py" scripts/bench/make_kjv_corpus.py "$cache/kjv.txt" "$corpus" "$SIZE_MB"

results="$(mktemp -d)"
trap 'rm -rf "$results"' EXIT
measure() { "$py" scripts/bench/measure.py "$@"; }
for run in $(seq "$RUNS"); do
  echo "round $run/$RUNS" >&2
  rm -f "$results"/*_text_document.*
  PYTHONPATH="$MEGATRON_LM" measure "$results/megatron.$run.json" -- "$py" "$MEGATRON_LM/tools/preprocess_data.py" \
    --input "$corpus" --output-prefix "$results/megatron" --json-keys text --append-eod --workers "$WORKERS" \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$tok"
  measure "$results/mindkit.$run.json" -- "$bin" preprocess --input "$corpus" --output-prefix "$results/mindkit" \
    --tokenizer "$tok" --append-eod --workers "$WORKERS" --no-special-tokens --quiet
  measure "$results/mindkit-bos.$run.json" -- "$bin" preprocess --input "$corpus" --output-prefix "$results/mindkit-bos" \
    --tokenizer "$tok" --append-eod --workers "$WORKERS" --quiet
  RAYON_NUM_THREADS="$WORKERS" "$py" scripts/bench/hf_ceiling.py "$tok" "$corpus" \
    "$results/hf-tokenizers-ceiling.$run.json" --no-special-tokens
  for ext in bin idx; do
    cmp "$results/megatron_text_document.$ext" "$results/mindkit_text_document.$ext" \
      || { echo "mindkit's .$ext differs from Megatron's" >&2; exit 1; }
  done
done
echo "outputs byte-identical to Megatron's in every round" >&2
"$py" scripts/bench/summarize.py "$results" "$corpus"

if (( BIG_GB > 0 )); then
  big="$cache/kjv-${BIG_GB}gb.jsonl"
  if [[ ! -s "$big" ]]; then
    while (( $(stat -c %s "$big.part" 2>/dev/null || echo 0) < BIG_GB * 1000000000 )); do cat "$corpus" >>"$big.part"; done
    mv "$big.part" "$big"
  fi
  rm -f "$results"/*_text_document.*
  measure "$results/big.json" -- "$bin" preprocess --input "$big" --output-prefix "$results/big" \
    --tokenizer "$tok" --append-eod --workers "$WORKERS" --quiet
  "$py" scripts/bench/big_summary.py "$results/big.json" "$big"
fi
