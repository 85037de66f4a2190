"""Prints the benchmark table (medians over runs) from the result files of bench-preprocess.sh.
Usage: summarize.py RESULTS_DIR CORPUS.jsonl"""
import json
import os
import re
import statistics
import sys

DTYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 8, 8: 2}  # Megatron .idx dtype codes


def tokens_written(prefix):
    with open(prefix + ".idx", "rb") as f:
        header = f.read(18)
    return os.path.getsize(prefix + ".bin") // DTYPE_SIZES[header[17]]


def main(results, corpus):
    docs = sum(1 for _ in open(corpus, encoding="utf-8"))
    mb = os.path.getsize(corpus) / 1e6
    rows = {}
    for name in sorted(os.listdir(results)):
        if name.endswith(".json"):
            tool = name.rsplit(".", 2)[0]
            rows.setdefault(tool, []).append(json.load(open(os.path.join(results, name))))
    print(f"corpus: {corpus}: {docs} documents, {mb:.1f} MB; medians of {len(rows['megatron'])} runs\n")
    print("| tool | wall s | docs/s | MB/s | M tokens/s | peak RSS (process tree) |")
    print("|---|---:|---:|---:|---:|---:|")
    rates = {}
    for tool, runs in rows.items():
        wall = statistics.median(r["wall_s"] for r in runs)
        tokens = runs[0].get("tokens") or tokens_written(os.path.join(results, tool + "_text_document"))
        peak = [r["peak_rss_mb"] for r in runs if r["peak_rss_mb"] is not None]
        rss = f"{statistics.median(peak):.0f} MB" if peak else "n/a (in-process)"
        rates[tool] = docs / wall
        print(f"| {tool} | {wall:.2f} | {docs / wall:.0f} | {mb / wall:.2f} | {tokens / wall / 1e6:.2f} | {rss} |")
    print()
    print(f"mindkit / Megatron (docs/s, wall clock): {rates['mindkit'] / rates['megatron']:.2f}x")
    print(f"mindkit / HF tokenizers ceiling:        {rates['mindkit'] / rates['hf-tokenizers-ceiling']:.0%}")
    own = [re.findall(r"\(([\d.]+) docs/s", r["stderr_tail"]) for r in rows["megatron"]]
    own = statistics.median(float(found[-1]) for found in own if found)
    print(f"Megatron's own last progress line (steady state, startup excluded): {own:.0f} docs/s; "
          f"mindkit / that: {rates['mindkit'] / own:.2f}x")


if __name__ == "__main__":
    main(*sys.argv[1:])
