"""Builds the benchmark corpus: the King James Bible (Debian bible-kjv, public domain), one JSON
document per chapter, the whole book repeated (with the repeat number in each document) until the
file reaches the requested size.  Usage: make_kjv_corpus.py kjv.txt out.jsonl SIZE_MB"""
import json
import re
import sys

verse = re.compile(r"^(\w+?)(\d+):(\d+) (.*)$")


def chapters(path):
    key, lines = None, []
    for line in open(path, encoding="utf-8"):
        m = verse.match(line.rstrip("\n"))
        if not m:
            continue
        if (m[1], m[2]) != key and lines:
            yield key, lines
            lines = []
        key = (m[1], m[2])
        lines.append(f"{m[3]} {m[4]}")
    if lines:
        yield key, lines


def main(src, out, size_mb):
    book = list(chapters(src))
    target = int(float(size_mb) * 1e6)
    written, repeat = 0, 0
    with open(out, "w", encoding="utf-8") as f:
        while written < target:
            repeat += 1
            for (name, chapter), lines in book:
                doc = {"id": f"{name}{chapter}/{repeat}", "text": "\n".join(lines)}
                written += f.write(json.dumps(doc, ensure_ascii=False) + "\n")
                if written >= target:
                    break


if __name__ == "__main__":
    main(*sys.argv[1:])
