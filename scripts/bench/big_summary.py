"""Prints the large-input line of bench-preprocess.sh. Usage: big_summary.py RESULT.json INPUT"""
import json
import os
import sys

result = json.load(open(sys.argv[1]))
gb = os.path.getsize(sys.argv[2]) / 1e9
wall = result["wall_s"]
print(f"\nlarge input: {gb:.1f} GB in {wall:.0f} s ({gb * 1e3 / wall:.1f} MB/s), "
      f"mindkit peak RSS {result['peak_rss_mb']:.0f} MB")
