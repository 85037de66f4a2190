"""MMLU for the harness without downloads: the original csv tree (what mindkit reads) copied for
the chosen subjects, the same rows converted by Python's csv module to the harness's cais/mmlu
layout, and one local task yaml per subject that `include`s the harness's own."""
import csv
import json
import pathlib

import lm_eval

HARNESS_TASKS = pathlib.Path(lm_eval.__file__).parent / "tasks"


def build(testdata, dest, subjects):
    """Returns (the csv tree for mindkit, the yaml directory, the local task names); the val
    split stands in for test."""
    tree, converted, tasks = dest / "mmlu", dest / "hf", dest / "tasks"
    tasks.mkdir(parents=True)
    for subject in subjects:
        (converted / subject).mkdir(parents=True)
        for split, target in (("dev", "dev"), ("val", "test")):
            src = testdata / f"mmlu/{split}/{subject}_{split}.csv"
            (tree / split).mkdir(parents=True, exist_ok=True)
            (tree / split / src.name).write_bytes(src.read_bytes())
            with open(src, newline="") as f, open(converted / subject / f"{target}.jsonl", "w") as out:
                for q, a, b, c, d, ans in csv.reader(f):
                    out.write(json.dumps({"question": q, "subject": subject, "choices": [a, b, c, d],
                                          "answer": "ABCD".index(ans)}) + "\n")
        (tasks / f"local_mmlu_{subject}.yaml").write_text(
            f"""include: {HARNESS_TASKS / f"mmlu/default/mmlu_{subject}.yaml"}
task: local_mmlu_{subject}
tag: null
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    dev: {converted / subject / "dev.jsonl"}
    test: {converted / subject / "test.jsonl"}
""")
    return tree, tasks, [f"local_mmlu_{s}" for s in subjects]
