"""Summary of scripts/bench-train.sh and scripts/bench-train-dp.sh: per shape, the median over
runs of each run's median time per iteration (the first iteration, a warm-up, dropped) of PyTorch
and of each mindkit mode, the ratio to PyTorch, and peak RSS.
Usage: train_summary.py WORK_DIR "SHAPES" ["MODES" (default "fp32 bf16")]
Files: WORK_DIR/torch-SHAPE.RUN.{jsonl,json}, WORK_DIR/mindkit-SHAPE-MODE.RUN.{log,json}."""
import glob
import json
import re
import statistics
import sys

work, shapes = sys.argv[1], sys.argv[2].split()
modes = (sys.argv[3] if len(sys.argv) > 3 else "fp32 bf16").split()


def mindkit_ms(path):
    ms = [float(m) for m in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", open(path).read())]
    return statistics.median(ms[1:])


def torch_ms(path):
    # gloo prints its own lines on stdout too: the result is the JSON line
    result = [line for line in open(path) if line.startswith("{")][-1]
    return statistics.median(json.loads(result)["ms_per_iteration"][1:])


def rss(pattern):
    return max(json.load(open(p))["peak_rss_mb"] for p in glob.glob(pattern))


print("| shape | PyTorch ms/iter | " + " | ".join(f"mindkit {m} | ratio" for m in modes)
      + " | peak RSS PyTorch / " + " / ".join(modes) + " (MB) |")
print("|---|---:|" + "---:|---:|" * len(modes) + "---|")
for shape in shapes:
    t = statistics.median(torch_ms(p) for p in glob.glob(f"{work}/torch-{shape}.*.jsonl"))
    cells = []
    for mode in modes:
        m = statistics.median(mindkit_ms(p) for p in glob.glob(f"{work}/mindkit-{shape}-{mode}.*.log"))
        cells.append(f"{m:.0f} | {t / m:.2f}×")
    memory = [rss(f"{work}/torch-{shape}.*.json")] + [rss(f"{work}/mindkit-{shape}-{m}.*.json") for m in modes]
    print(f"| {shape} | {t:.0f} | " + " | ".join(cells) + " | " + " / ".join(f"{r:.0f}" for r in memory) + " |")
