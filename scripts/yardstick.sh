#!/usr/bin/env bash
# The MindSpeed-LLM yardstick (docs/training.md, "The MindSpeed-LLM yardstick"): runs the
# launch scripts of a MindSpeed-LLM checkout, shrunk to a tiny model, through a mindkit binary.
#   scripts/yardstick.sh MINDSPEED_LLM_DIR [yardstick.py options: --filter qwen3 --peel --json OUT …]
# The binary is $MINDKIT_BIN (default target/release/mindkit, not rebuilt here), the tokenizers
# come from $MINDKIT_ASSETS (default ~/.cache/mindkit/assets; scripts/fetch-test-assets.sh).
# Not part of CI.
set -euo pipefail
[[ $# -ge 1 ]] || { sed -n '2,7p' "$0" >&2; exit 2; }
here="$(cd "$(dirname "$0")/.." && pwd)"
msllm="$1"; shift
exec python3 "$here/scripts/yardstick.py" --mindspeed-llm "$msllm" \
  --mindkit "${MINDKIT_BIN:-$here/target/release/mindkit}" \
  --assets "${MINDKIT_ASSETS:-${MINDKIT_CACHE:-$HOME/.cache/mindkit}/assets}" "$@"
