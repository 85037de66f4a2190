"""`mindkit eval` against lm-evaluation-harness (HF backend, Python API, local data files, no
downloads) on the real SmolLM2-135M-Instruct: per-request loglikelihoods within 1e-3 and the
same accuracy, on the BoolQ sample in $MINDKIT_TESTDATA."""
import json
import os
import pathlib
import subprocess

import lm_eval
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("MINDKIT_BIN", str(ROOT / "target/release/mindkit"))
LIMIT = 40
HARNESS_TASKS = pathlib.Path(lm_eval.__file__).parent / "tasks"


def harness_samples(tmp_path, model_dir, task, yaml_text):
    """Run a local copy of a harness task (its yaml `include`d, data from files) and return
    its per-document samples."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / f"{task}.yaml").write_text(yaml_text)
    os.environ["HF_HUB_OFFLINE"] = "1"
    out = simple_evaluate(model="hf", model_args=f"pretrained={model_dir},dtype=float32",
                          tasks=[task], limit=LIMIT, log_samples=True, batch_size=1,
                          device="cpu", task_manager=TaskManager(include_path=str(tasks)))
    return sorted(out["samples"][task], key=lambda s: s["doc_id"]), out["results"][task]


def test_boolq_matches_the_harness(smollm2, testdata, tmp_path):
    data = testdata / "boolq/dev_200.jsonl"
    yaml_text = f"""include: {HARNESS_TASKS / "super_glue/boolq/default.yaml"}
task: boolq_local
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    validation: {data}
training_split: null
doc_to_target: "{{{{ 1 if label in ['true', True, 1] else 0 }}}}"
"""
    samples, results = harness_samples(tmp_path, smollm2, "boolq_local", yaml_text)
    log = tmp_path / "mindkit.jsonl"
    out = tmp_path / "results.json"
    subprocess.run([BIN, "eval", "--model", smollm2, "--task", "boolq", "--data", data,
                    "--limit", str(LIMIT), "--batch-size", "4", "--log-samples", log,
                    "--output", out, "--quiet"], check=True, capture_output=True)
    ours = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(ours) == len(samples) == LIMIT
    for mine, theirs in zip(ours, samples):
        harness_lls = [r[0][0] for r in theirs["resps"]]
        assert len(mine["logprobs"]) == len(harness_lls) == 2
        assert mine["prompt"] + mine["choices"][0] == theirs["arguments"][0][0] + theirs["arguments"][0][1]
        for a, b in zip(mine["logprobs"], harness_lls):
            assert abs(a - b) <= 1e-3, (mine["doc_id"], mine["logprobs"], harness_lls)
        assert mine["acc"] == bool(theirs["acc"])
    acc = json.loads(out.read_text())["results"]["boolq"]["acc,none"]
    assert acc == pytest.approx(results["acc,none"], abs=1e-12)
