"""Medians of scripts/bench-eval.sh rounds: prefill and decode tokens/s of each side, the ratios,
and the decode bound (copy bandwidth ÷ weight bytes read per token).
    python eval_summary.py WORK_DIR CACHE_DIR"""
import json
import statistics
import sys
from pathlib import Path


def runs(work, name):
    out = {}
    for f in sorted(Path(work).glob(f"{name}.*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            out.setdefault(r["what"], []).append(r.get("tokens_per_s", r.get("bytes_per_s")))
    return {k: statistics.median(v) for k, v in out.items()}


def main(work, cache):
    hf = runs(work, "transformers-fp32")
    rows = [("transformers fp32", hf)]
    for dtype in ("fp32", "bf16"):
        rows.append((f"mindkit {dtype}", runs(work, f"mindkit-{dtype}")))
    print(f"{'':24} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for name, r in rows:
        print(f"{name:24} {r['prefill']:14.0f} {r['decode']:13.1f}")
    for name, r in rows[1:]:
        print(f"{name} / transformers fp32: prefill {r['prefill'] / hf['prefill']:.2f}x, "
              f"decode {r['decode'] / hf['decode']:.2f}x")
    copy = rows[1][1]["copy"]
    for dtype, (_, r) in zip(("fp32", "bf16"), rows[1:]):
        weights = sum(f.stat().st_size for f in Path(cache, f"smollm2-{dtype}").glob("*.safetensors"))
        bound = copy / weights
        print(f"mindkit {dtype}: weights {weights / 1e6:.0f} MB, copy {copy / 1e9:.1f} GB/s, decode "
              f"bound {bound:.1f} tok/s, reached {r['decode'] / bound:.0%}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
