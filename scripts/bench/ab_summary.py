"""Summary of scripts/bench-ab.sh: per training shape and mode, the median over rounds of each
run's median time per iteration (first iteration dropped) of builds A and B, and per weight dtype
the median prefill and decode tokens/s; ratios B / A in speed (> 1: B faster).
Usage: ab_summary.py WORK_DIR "SHAPES" ["MODES"] (a mode a build cannot run, e.g. dropout before
it was built, shows "–").
Files: WORK_DIR/train-BUILD-SHAPE-MODE.RUN.log, WORK_DIR/engine-BUILD-DTYPE.RUN.jsonl."""
import glob
import json
import re
import statistics
import sys

work, shapes = sys.argv[1], sys.argv[2].split()
modes = (sys.argv[3] if len(sys.argv) > 3 else "fp32 bf16").split()


def iteration_ms(path):
    ms = [float(m) for m in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", open(path).read())]
    return statistics.median(ms[1:]) if len(ms) > 1 else None


def median_over_runs(pattern, value):
    values = [v for v in (value(p) for p in glob.glob(pattern)) if v is not None]
    return statistics.median(values) if values else float("nan")


def engine(path, what):
    return next(json.loads(line)["tokens_per_s"] for line in open(path) if f'"{what}"' in line)


print("| training | A ms/iter | B ms/iter | B speed / A |")
print("|---|---:|---:|---:|")
for shape in shapes:
    for mode in modes:
        a, b = (median_over_runs(f"{work}/train-{x}-{shape}-{mode}.*.log", iteration_ms) for x in "ab")
        print(f"| {shape} {mode} | {a:.0f} | {b:.0f} | {a / b:.3f} |")
print()
print("| engine (SmolLM2-135M) | A tokens/s | B tokens/s | B / A |")
print("|---|---:|---:|---:|")
for dtype in ("fp32", "bf16"):
    for what in ("prefill", "decode"):
        a, b = (median_over_runs(f"{work}/engine-{x}-{dtype}.*.jsonl", lambda p: engine(p, what))
                for x in "ab")
        print(f"| {dtype} {what} | {a:.1f} | {b:.1f} | {b / a:.3f} |")
