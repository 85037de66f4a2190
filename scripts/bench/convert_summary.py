"""Medians of the convert and lora benchmarks' measure.py results.
Usage: convert_summary.py RESULTS_DIR HF_DIR [ONLY_PREFIX]"""
import json
import statistics
import sys
from pathlib import Path

ROWS = [("torch-hf2mg", "torch script HF → Megatron TP2 PP2"),
        ("mindkit-hf2mg", "mindkit HF → Megatron TP2 PP2"),
        ("mindkit-mg2hf", "mindkit Megatron TP2 PP2 → HF"),
        ("cp", "cp -r (same bytes)"),
        ("big-hf2mg", "mindkit HF → Megatron TP2 PP2 (7B-shaped)"),
        ("convert-hf2hf", "mindkit convert HF → HF"),
        ("merge-hf", "mindkit lora merge → HF"),
        ("convert-hf2mg", "mindkit convert HF → Megatron TP2 PP2"),
        ("merge-mg", "mindkit lora merge → Megatron TP2 PP2"),
        ("peft-merge", "peft merge_and_unload + save_pretrained"),
        ("msl-moe", "MindSpeed-LLM convert_ckpt_v2 → TP2 EP4 grouped"),
        ("mindkit-moe", "mindkit HF → Megatron TP2 EP4 grouped"),
        ("torch-dist2hf", "torch dcp_to_torch_save + torch → HF"),
        ("mindkit-dist2hf", "mindkit torch_dist → HF")]
RATIOS = [("msl-moe", "mindkit-moe", "MindSpeed-LLM's converter / mindkit (MoE → TP2 EP4): mindkit is this many times faster"),
          ("merge-hf", "convert-hf2hf", "lora merge → HF / plain convert → HF"),
          ("merge-mg", "convert-hf2mg", "lora merge → Megatron / plain convert → Megatron"),
          ("peft-merge", "merge-hf", "peft / mindkit lora merge (→ HF): mindkit is this many times faster"),
          ("torch-dist2hf", "mindkit-dist2hf", "torch path / mindkit (torch_dist → HF): mindkit is this many times faster")]


def main(results, hf, only=None):
    results, hf = Path(results), Path(hf)
    size = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
    med = {}
    print(f"input: {hf} ({size / 1e9:.2f} GB)")
    print(f"{'':44} {'wall s':>8} {'GB/s':>6} {'peak RSS MB':>12}")
    for key, label in ROWS:
        if only and key != only:
            continue
        runs = [json.loads(p.read_text()) for p in sorted(results.glob(f"{key}.*json"))]
        if not runs:
            continue
        wall = statistics.median(r["wall_s"] for r in runs)
        rss = statistics.median(r["peak_rss_mb"] for r in runs)
        med[key] = wall
        print(f"{label:44} {wall:8.2f} {size / 1e9 / wall:6.2f} {rss:12.0f}   (n={len(runs)})")
    if "torch-hf2mg" in med and "mindkit-hf2mg" in med:
        print(f"mindkit vs torch script (HF → Megatron): {med['torch-hf2mg'] / med['mindkit-hf2mg']:.2f}x faster")
    for a, b, label in RATIOS:
        if a in med and b in med:
            print(f"{label}: {med[a] / med[b]:.2f}")
    if "cp" in med:
        for k in ("mindkit-hf2mg", "mindkit-mg2hf", "mindkit-dist2hf"):
            if k in med:
                print(f"{k} / cp -r: {med[k] / med['cp']:.2f}x the time of a plain copy")


if __name__ == "__main__":
    main(*sys.argv[1:])
