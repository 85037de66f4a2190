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


def boolq_yaml(data):
    """The harness's BoolQ task reading the local file `data`."""
    return f"""include: {HARNESS_TASKS / "super_glue/boolq/default.yaml"}
task: boolq_local
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    validation: {data}
training_split: null
doc_to_target: "{{{{ 1 if label in ['true', True, 1] else 0 }}}}"
"""


def test_boolq_matches_the_harness(smollm2, testdata, tmp_path):
    data = testdata / "boolq/dev_200.jsonl"
    yaml_text = boolq_yaml(data)
    samples, results = harness_samples(tmp_path, smollm2, "boolq_local", yaml_text)
    log = tmp_path / "mindkit.jsonl"
    out = tmp_path / "results.json"
    cache = tmp_path / "cache.jsonl"

    def run_mindkit(limit, log):
        subprocess.run([BIN, "eval", "--model", smollm2, "--task", "boolq", "--data", data,
                        "--limit", str(limit), "--batch-size", "4", "--log-samples", log,
                        "--output", out, "--cache", cache, "--quiet"], check=True,
                       capture_output=True)
        return [json.loads(line) for line in log.read_text().splitlines()]

    # Half the documents first, as if the run had been interrupted; the full run then
    # computes only the rest, and reports the same as a run from scratch would.
    run_mindkit(LIMIT // 2, tmp_path / "first-half.jsonl")
    ours = run_mindkit(LIMIT, log)
    assert json.loads(out.read_text())["config"]["cache"]["reused_docs"] == LIMIT // 2
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


def tiny_phimoe_with_llama2s_tokenizer(out, tok_dir):
    """A tiny Phi-3.5-MoE (test_engine.py's) over the Llama-2 tokenizer Phi-3.5 extends."""
    import shutil
    from transformers import AutoTokenizer
    from test_engine import tiny_phimoe
    vocab = len(AutoTokenizer.from_pretrained(tok_dir))
    tiny_phimoe(out, vocab_size=vocab, max_position_embeddings=2048)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / f, out / f)


@pytest.mark.parametrize("family", ["qwen3", "phimoe"])
def test_boolq_on_tiny_models_matches_the_harness(assets, testdata, tmp_path, family):
    """Families beside SmolLM2's under `mindkit eval`: Qwen3 (q/k norms, head_dim ≠ hidden /
    heads) and Phi-3.5-MoE (LayerNorms, biases, SparseMixer-routed experts): BoolQ
    loglikelihoods within 1e-3 of the harness's and the same accuracy."""
    import tiny_qwen3
    model_dir = tmp_path / family
    if family == "qwen3":
        tiny_qwen3.build(model_dir, assets / "qwen3")
    else:
        tiny_phimoe_with_llama2s_tokenizer(model_dir, assets / "llama2")
    data = testdata / "boolq/dev_200.jsonl"
    yaml_text = boolq_yaml(data)
    samples, results = harness_samples(tmp_path, model_dir, "boolq_local", yaml_text)
    log, out = tmp_path / "mindkit.jsonl", tmp_path / "results.json"
    subprocess.run([BIN, "eval", "--model", model_dir, "--task", "boolq", "--data", data,
                    "--limit", str(LIMIT), "--batch-size", "4", "--log-samples", log,
                    "--output", out, "--quiet"], check=True, capture_output=True)
    ours = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(ours) == len(samples) == LIMIT
    for mine, theirs in zip(ours, samples):
        harness_lls = [r[0][0] for r in theirs["resps"]]
        for a, b in zip(mine["logprobs"], harness_lls):
            assert abs(a - b) <= 1e-3, (mine["doc_id"], mine["logprobs"], harness_lls)
        assert mine["acc"] == bool(theirs["acc"])
    acc = json.loads(out.read_text())["results"]["boolq"]["acc,none"]
    assert acc == pytest.approx(results["acc,none"], abs=1e-12)


MMLU_SUBJECTS = ["abstract_algebra", "college_medicine", "econometrics",
                 "high_school_european_history", "professional_law", "world_religions"]


def test_mmlu_matches_the_harness(smollm2, testdata, tmp_path):
    # mindkit reads the original csv tree; the harness reads the same rows converted (by
    # Python's csv module) to its cais/mmlu layout.
    import mmlu_local
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    tree, tasks, names = mmlu_local.build(testdata, tmp_path, MMLU_SUBJECTS)
    os.environ["HF_HUB_OFFLINE"] = "1"
    limit = 2
    out = simple_evaluate(model="hf", model_args=f"pretrained={smollm2},dtype=float32",
                          tasks=names, num_fewshot=5,
                          limit=limit, log_samples=True, batch_size=1, device="cpu",
                          task_manager=TaskManager(include_path=str(tasks)))
    log = tmp_path / "mindkit.jsonl"
    results = tmp_path / "results.json"
    subprocess.run([BIN, "eval", "--model", smollm2, "--task", "mmlu", "--data", tree,
                    "--limit", str(limit), "--log-samples", log, "--output", results, "--quiet"],
                   check=True, capture_output=True)
    ours = [json.loads(line) for line in log.read_text().splitlines()]
    theirs = [s for subject in MMLU_SUBJECTS
              for s in sorted(out["samples"][f"local_mmlu_{subject}"], key=lambda s: s["doc_id"])]
    assert len(ours) == len(theirs) == limit * len(MMLU_SUBJECTS)
    for mine, sample in zip(ours, theirs):
        assert mine["prompt"] == sample["arguments"][0][0]
        harness_lls = [r[0][0] for r in sample["resps"]]
        assert len(mine["logprobs"]) == len(harness_lls) == 4
        for a, b in zip(mine["logprobs"], harness_lls):
            assert abs(a - b) <= 1e-3, (mine["subject"], mine["logprobs"], harness_lls)
        assert mine["acc"] == bool(sample["acc"])
    hits = sum(m["acc"] for m in ours)
    got = json.loads(results.read_text())["results"]
    assert got["mmlu"]["acc,none"] == pytest.approx(hits / len(ours))
    assert got["mmlu"]["sample_len"] == len(ours)


@pytest.mark.parametrize("task, harness_yaml, result_key, batch", [
    ("gsm8k-cot", "gsm8k/gsm8k-cot.yaml", "gsm8k_cot", 1),
    ("gsm8k", "gsm8k/gsm8k.yaml", "gsm8k", 3),
])
def test_gsm8k_generations_match_the_harness(smollm2, testdata, tmp_path, task, harness_yaml,
                                             result_key, batch):
    # gsm8k draws 5 shots per question from the train split with random.Random(1234): equal
    # prompts mean mindkit's port of CPython's sampler made the same draws. The harness
    # generates one question at a time; mindkit decodes `batch` questions together.
    data = testdata / "gsm8k/test_200.jsonl"
    limit = 3
    local = f"local_{result_key}"
    yaml_text = f"""include: {HARNESS_TASKS / harness_yaml}
task: {local}
tag: null
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    train: {testdata / "gsm8k/train.jsonl"}
    test: {data}
"""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / f"{local}.yaml").write_text(yaml_text)
    os.environ["HF_HUB_OFFLINE"] = "1"
    out = simple_evaluate(model="hf", model_args=f"pretrained={smollm2},dtype=float32",
                          tasks=[local], limit=limit, log_samples=True, batch_size=1,
                          device="cpu", task_manager=TaskManager(include_path=str(tasks)))
    log = tmp_path / "mindkit.jsonl"
    results = tmp_path / "results.json"
    subprocess.run([BIN, "eval", "--model", smollm2, "--task", task, "--data", data,
                    "--limit", str(limit), "--batch-size", str(batch), "--log-samples", log,
                    "--output", results, "--quiet"],
                   check=True, capture_output=True)
    ours = [json.loads(line) for line in log.read_text().splitlines()]
    theirs = {}
    for s in out["samples"][local]:
        theirs.setdefault(s["doc_id"], {})[s["filter"]] = s
    assert len(ours) == len(theirs) == limit
    for mine in ours:
        by_filter = theirs[mine["doc_id"]]
        first = next(iter(by_filter.values()))
        assert mine["prompt"] == first["arguments"][0][0]
        assert mine["generation"] == first["resps"][0][0]
        for name, sample in by_filter.items():
            assert mine[name] == sample["filtered_resps"][0], name
            assert mine["correct"][name] == bool(sample["exact_match"]), name
    got = json.loads(results.read_text())["results"][result_key]
    for name in ("strict-match", "flexible-extract"):
        want = out["results"][local][f"exact_match,{name}"]
        assert got[f"exact_match,{name}"] == pytest.approx(want)
