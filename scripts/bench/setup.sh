# Shared set-up of the checkpoint benchmarks (sourced by bench-convert.sh and bench-lora.sh):
# the interop venv ($py), a release build ($bin), the random TinyLlama-shaped bf16 HF checkpoint
# ($hf, cached in $cache), a work directory under ${OUT:-$cache} removed on exit ($work), and
# `measure OUT.json -- CMD…` (sync + pause, then wall time and peak RSS of the process tree).
cache="${MINDKIT_CACHE:-$HOME/.cache/mindkit}/bench"
mkdir -p "$cache"
venv="$(bash scripts/setup-interop-venv.sh)"
py="$venv/bin/python"
cargo build --release --bin mindkit >&2
bin="$PWD/target/release/mindkit"
hf="$cache/tinyllama-hf"
[[ -f "$hf/config.json" ]] || "$py" scripts/bench/make_random_hf.py tinyllama "$hf"
work="$(mktemp -d "${OUT:-$cache}/mindkit-bench.XXXXXX")"
trap 'rm -rf "$work"' EXIT
measure() { sync; sleep 2; "$py" scripts/bench/measure.py "$@"; }
