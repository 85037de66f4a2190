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
