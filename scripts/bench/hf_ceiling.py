"""The ceiling: the HF `tokenizers` library alone, `encode_batch` over the corpus texts in memory
(RAYON_NUM_THREADS sets its threads; no JSON parsing or writing is timed).
Usage: hf_ceiling.py TOKENIZER_DIR CORPUS.jsonl OUT.json [--no-special-tokens]"""
import json
import sys
import time

from tokenizers import Tokenizer


def main(tok_dir, corpus, out, *flags):
    tok = Tokenizer.from_file(f"{tok_dir}/tokenizer.json")
    texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
    start = time.perf_counter()
    encodings = tok.encode_batch(texts, add_special_tokens="--no-special-tokens" not in flags)
    wall = time.perf_counter() - start
    tokens = sum(len(e.ids) for e in encodings)
    with open(out, "w") as f:
        json.dump({"wall_s": wall, "tokens": tokens, "peak_rss_mb": None}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
