//! Task data readers and prompts (the harness's strings), and bad data named by file and row.
//! The scores themselves are checked against lm-evaluation-harness in tests/interop.

mod common;

use common::{fixture, mindkit};
use mindkit::eval::{boolq, gsm8k, mmlu};

#[test]
fn boolq_reads_every_layout_into_the_harness_prompt() {
    for file in ["eval/boolq-original.jsonl", "eval/boolq-superglue.jsonl"] {
        let docs = boolq::load(&fixture(file), None).unwrap();
        assert_eq!(docs.len(), 2, "{file}");
        assert_eq!(
            docs[0].context,
            "Sky -- The sky is blue.\nQuestion: is the sky blue?\nAnswer:"
        );
        assert_eq!(docs[0].choices, [" no", " yes"]);
        assert_eq!((docs[0].gold, docs[1].gold), (1, 0), "{file}");
    }
}

#[test]
fn mmlu_reads_quoted_csv_and_builds_the_five_shot_prompt() {
    let docs = mmlu::load(&fixture("eval/mmlu"), None).unwrap();
    assert_eq!(docs.len(), 2);
    let expected_start = "The following are multiple choice questions (with answers) about \
        abstract algebra.\n\nWhat is 1+1?\nA. 1\nB. 2\nC. 3\nD. 4\nAnswer: B\n\n\
        A question, with a comma\nA. x\nB. y\nC. z\nD. w\nAnswer: A\n\n\
        Line one\nline two \"quoted\"\nA. a\nB. b\nC. c\nD. d\nAnswer: D\n\n";
    assert!(
        docs[0].context.starts_with(expected_start),
        "{}",
        docs[0].context
    );
    assert!(docs[0]
        .context
        .ends_with("Which group?\nA. Z, the integers\nB. Q\nC. R\nD. C\nAnswer:"));
    // The question is stripped (question.strip()), the choices are not.
    assert!(docs[1]
        .context
        .ends_with("\n\nPadded question\nA. a\nB. b\nC. c\nD. d\nAnswer:"));
    assert_eq!((docs[0].gold, docs[1].gold), (0, 2));
    assert_eq!(docs[0].choices, [" A", " B", " C", " D"]);
    assert_eq!(docs[0].subject.as_deref(), Some("abstract_algebra"));
    let zero = mmlu::load(&fixture("eval/mmlu"), Some(0)).unwrap();
    assert!(zero[0]
        .context
        .ends_with("algebra.\n\nWhich group?\nA. Z, the integers\nB. Q\nC. R\nD. C\nAnswer:"));
    let err = mmlu::load(&fixture("eval/mmlu"), Some(6))
        .unwrap_err()
        .to_string();
    assert!(err.contains("5 dev rows"), "{err}");
}

#[test]
fn gsm8k_cot_prompt_and_target() {
    let docs = gsm8k::load(
        &fixture("eval/gsm8k.jsonl"),
        gsm8k::Variant::Cot,
        Default::default(),
    )
    .unwrap();
    assert_eq!(docs[0].target, "7");
    assert!(docs[0]
        .context
        .starts_with("Q: There are 15 trees in the grove."));
    assert!(docs[0]
        .context
        .contains("The answer is 6.\n\nQ: If there are 3 cars"));
    assert!(docs[0]
        .context
        .ends_with("The answer is 8.\n\nQ: Tom has 3 apples and buys 4 more. How many apples does he have?\nA:"));
    assert_eq!(docs[0].context.matches("\nA: ").count(), 8);
}

/// The problem numbers of the shots in a prompt built from fixtures/eval/gsm8k-train.jsonl.
fn shot_order(context: &str) -> Vec<usize> {
    context
        .split("Question: Problem ")
        .skip(1)
        .map(|s| s[..1].parse().unwrap())
        .collect()
}

#[test]
fn gsm8k_draws_its_shots_as_the_harness_does() {
    // fixtures/eval/gsm8k-train.jsonl holds 7 problems; CPython's
    // random.Random(1234).sample(range(7), 5) is [6, 3, 0, 4, 5].
    let train = fixture("eval/gsm8k-train.jsonl");
    let docs = gsm8k::load(
        &fixture("eval/gsm8k.jsonl"),
        gsm8k::Variant::Standard,
        gsm8k::FewShot {
            data: Some(&train),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(shot_order(&docs[0].context), [6, 3, 0, 4, 5]);
    assert!(docs[0].context.starts_with(
        "Question: Problem 6: Ann has 9 pens and buys 22 more. How many pens does she have?\n\
         Answer: She has 9 + 22 = <<9+22=31>>31 pens.\n#### 31\n\nQuestion: Problem 3:"
    ));
    assert!(docs[0].context.ends_with(
        "\n\nQuestion: Tom has 3 apples and buys 4 more. How many apples does he have?\nAnswer:"
    ));
    assert_eq!(docs[0].target, "7");
    // Without --fewshot-data the train split is looked for beside the data, and named if absent.
    let err = gsm8k::load(
        &fixture("eval/gsm8k.jsonl"),
        gsm8k::Variant::Standard,
        Default::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("train.jsonl") && err.contains("--fewshot-data"),
        "{err}"
    );
    // Another seed, other draws: CPython's random.Random(42).sample(range(7), 5).
    let docs = gsm8k::load(
        &fixture("eval/gsm8k.jsonl"),
        gsm8k::Variant::Standard,
        gsm8k::FewShot {
            data: Some(&train),
            seed: 42,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(shot_order(&docs[0].context), [5, 0, 6, 2, 4]);
}

#[test]
fn bad_data_names_the_file_and_row() {
    let err = boolq::load(&fixture("eval/boolq-bad.jsonl"), None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("boolq-bad.jsonl") && err.contains("2"),
        "{err}"
    );
    assert!(err.contains("\"maybe\""), "{err}");
    let err = mmlu::load(&fixture("eval/mmlu-bad"), None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("abstract_algebra_val.csv:row 2") && err.contains("\"E\""),
        "{err}"
    );
    let err = gsm8k::load(
        &fixture("eval/boolq-original.jsonl"),
        gsm8k::Variant::Cot,
        Default::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("\"answer\""), "{err}");
}

#[test]
fn eval_refuses_a_tokenizer_larger_than_the_model() {
    // The tiny models carry a 400-token tokenizer for a 200-row vocabulary.
    let out = mindkit(&[
        &"eval",
        &"--model",
        &fixture("models/llama"),
        &"--task",
        &"boolq",
        &"--data",
        &fixture("eval/boolq-original.jsonl"),
    ])
    .failure();
    let err = String::from_utf8_lossy(&out.get_output().stderr).to_string();
    assert!(
        err.contains("400 tokens") && err.contains("200 rows"),
        "{err}"
    );
}

/// `mindkit eval … --task boolq --data DATA EXTRA…` on the shipped demo model.
fn eval_demo(
    data: &std::path::Path,
    extra: &[&dyn AsRef<std::ffi::OsStr>],
) -> assert_cmd::assert::Assert {
    eval_model(&fixture("models/demo"), data, extra)
}

/// `mindkit eval … --model MODEL --task boolq --data DATA EXTRA…`.
fn eval_model(
    model: &std::path::Path,
    data: &std::path::Path,
    extra: &[&dyn AsRef<std::ffi::OsStr>],
) -> assert_cmd::assert::Assert {
    let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![
        &"eval", &"--quiet", &"--model", &model, &"--task", &"boolq", &"--data", &data,
    ];
    args.extend_from_slice(extra);
    mindkit(&args)
}

fn stderr(a: &assert_cmd::assert::Assert) -> String {
    String::from_utf8_lossy(&a.get_output().stderr).into_owned()
}

#[test]
fn the_demo_model_runs_generate_and_eval() {
    let out = mindkit(&[
        &"generate",
        &"--model",
        &fixture("models/demo"),
        &"--prompt",
        &"The sky",
        &"--max-new-tokens",
        &"5",
    ])
    .success();
    assert!(!out.get_output().stdout.is_empty());
    let out = eval_demo(&fixture("eval/boolq-superglue.jsonl"), &[]).success();
    let table = String::from_utf8_lossy(&out.get_output().stdout).into_owned();
    assert!(table.contains("boolq"), "{table}");
}

#[test]
fn a_cache_is_refused_after_the_weights_change() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    common::copy_dir(&fixture("models/demo"), &model);
    let cache = dir.path().join("cache.jsonl");
    let data = fixture("eval/boolq-superglue.jsonl");
    let run = |model: &std::path::Path| {
        mindkit(&[
            &"eval", &"--quiet", &"--model", &model, &"--task", &"boolq", &"--data", &data,
            &"--cache", &cache,
        ])
    };
    run(&model).success();
    // The same weights elsewhere keep the cache…
    let copy = dir.path().join("copy");
    common::copy_dir(&model, &copy);
    run(&copy).success();
    // …other weights at the same path do not: one byte of one tensor changed.
    let weights = model.join("model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&weights, bytes).unwrap();
    let err = stderr(&run(&model).failure());
    assert!(err.contains("holds results of another model"), "{err}");
}

#[test]
fn bad_sampling_and_limits_are_refused_up_front() {
    for (arg, says) in [
        ("--temperature=NaN", "--temperature"),
        ("--temperature=-1", "--temperature"),
        ("--top-p=0", "--top-p"),
    ] {
        let out = mindkit(&[
            &"generate",
            &"--model",
            &fixture("models/demo"),
            &"--prompt",
            &"x",
            &arg,
        ])
        .failure();
        assert!(stderr(&out).contains(says), "{arg}: {}", stderr(&out));
    }
    let data = fixture("eval/boolq-superglue.jsonl");
    let out = eval_demo(&data, &[&"--limit", &"0"]).failure();
    assert!(
        stderr(&out).contains("--limit must be at least 1"),
        "{}",
        stderr(&out)
    );
    let out = eval_demo(&data, &[&"--batch-size", &"0"]).failure();
    assert!(stderr(&out).contains("--batch-size"), "{}", stderr(&out));
}

#[test]
fn nan_weights_are_an_error_not_a_score() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    common::copy_dir(&fixture("models/demo"), &model);
    // Bad config numbers are refused when the config is read; NaN weights reach the scores.
    let path = model.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut bytes = bytes;
    for b in bytes[8 + header..].chunks_exact_mut(4) {
        b.copy_from_slice(&f32::NAN.to_le_bytes());
    }
    std::fs::write(&path, bytes).unwrap();
    let out = eval_model(&model, &fixture("eval/boolq-superglue.jsonl"), &[]).failure();
    assert!(
        stderr(&out).contains("non-finite loglikelihood"),
        "{}",
        stderr(&out)
    );
    let out = mindkit(&[&"generate", &"--model", &model, &"--prompt", &"x"]).failure();
    assert!(
        stderr(&out).contains("non-finite logit"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_malformed_data_line_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let good =
        r#"{"question": "is the sky blue", "passage": "Sky -- The sky is blue.", "label": 1}"#;
    for (name, bad, says) in [
        ("json.jsonl", b"{not json".to_vec(), "line 2"),
        (
            "utf8.jsonl",
            b"{\"question\": \"\xff\xfe\"}".to_vec(),
            "line 2",
        ),
        ("array.jsonl", b"[1, 2]".to_vec(), "line 2"),
    ] {
        let path = dir.path().join(name);
        let mut text = format!("{good}\n").into_bytes();
        text.extend_from_slice(&bad);
        text.push(b'\n');
        std::fs::write(&path, text).unwrap();
        let out = eval_demo(&path, &[]).failure();
        let err = stderr(&out);
        assert!(err.contains(name) && err.contains(says), "{name}: {err}");
        assert!(!err.trim_end().ends_with("stopped"), "{name}: {err}");
    }
}

#[test]
fn outputs_never_overwrite_inputs_and_fail_before_the_work() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("boolq.jsonl");
    std::fs::copy(fixture("eval/boolq-superglue.jsonl"), &data).unwrap();
    let before = std::fs::read(&data).unwrap();
    for flag in ["--output", "--log-samples", "--cache"] {
        let out = eval_demo(&data, &[&flag, &data]).failure();
        assert!(stderr(&out).contains(flag), "{flag}: {}", stderr(&out));
        assert_eq!(
            std::fs::read(&data).unwrap(),
            before,
            "{flag} touched the data"
        );
    }
    let same = dir.path().join("results.json");
    let out = eval_demo(&data, &[&"--output", &same, &"--log-samples", &same]).failure();
    assert!(
        stderr(&out).contains("name the same file"),
        "{}",
        stderr(&out)
    );
    // An output that cannot be created (its "directory" is a file) fails at once, before any
    // scoring.
    let blocker = dir.path().join("a-file");
    std::fs::write(&blocker, "x").unwrap();
    let missing = blocker.join("results.json");
    let out = eval_demo(&data, &[&"--output", &missing]).failure();
    assert!(stderr(&out).contains("--output"), "{}", stderr(&out));
    assert!(out.get_output().stdout.is_empty());
}
