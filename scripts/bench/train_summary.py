"""Summary of scripts/bench-train.sh: per shape, the median over runs of each run's median time
per iteration (the first iteration, a warm-up, dropped), the ratio to PyTorch, and peak RSS.
Usage: train_summary.py WORK_DIR "SHAPES" """
import glob
import json
import re
import statistics
import sys

work, shapes = sys.argv[1], sys.argv[2].split()


def mindkit_ms(path):
    ms = [float(m) for m in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", open(path).read())]
    return statistics.median(ms[1:])


def torch_ms(path):
    return statistics.median(json.load(open(path))["ms_per_iteration"][1:])


def rss(pattern):
    return max(json.load(open(p))["peak_rss_mb"] for p in glob.glob(pattern))


print("| shape | PyTorch fp32 ms/iter | mindkit fp32 | ratio | mindkit bf16 | ratio | peak RSS PyTorch / fp32 / bf16 (MB) |")
print("|---|---:|---:|---:|---:|---:|---|")
for shape in shapes:
    t = statistics.median(torch_ms(p) for p in glob.glob(f"{work}/torch-{shape}.*.jsonl"))
    m = {mode: statistics.median(mindkit_ms(p) for p in glob.glob(f"{work}/mindkit-{shape}-{mode}.*.log"))
         for mode in ("fp32", "bf16")}
    print(f"| {shape} | {t:.0f} | {m['fp32']:.0f} | {t / m['fp32']:.2f}× | {m['bf16']:.0f} | "
          f"{t / m['bf16']:.2f}× | {rss(f'{work}/torch-{shape}.*.json'):.0f} / "
          f"{rss(f'{work}/mindkit-{shape}-fp32.*.json'):.0f} / {rss(f'{work}/mindkit-{shape}-bf16.*.json'):.0f} |")
