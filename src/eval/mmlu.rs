//! MMLU as the harness's `mmlu` group (`docs/evaluation.md` §2): per subject, the description
//! `"The following are multiple choice questions (with answers) about {subject}.\n\n"`, the
//! first k dev rows as shots (`"{question}\nA. …\nD. …\nAnswer: {letter}\n\n"`), the question,
//! and the loglikelihoods of `" A"`…`" D"`. Reads the original csv tree (`dev/`, `val/`,
//! `test/`, `{subject}_{split}.csv`, no header: question, A, B, C, D, answer letter) or the HF
//! `cais/mmlu` layout (parquet/json/jsonl files named by split, with `subject`, `question`,
//! `choices`, `answer`). The test split is evaluated, or val where there is no test split.

use super::{read_records, text_field, ChoiceDoc};
use crate::data::source::Record;
use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The harness's group of each subject (`lm_eval/tasks/mmlu/_generate_configs.py`).
pub const SUBJECTS: [(&str, &str); 57] = [
    ("abstract_algebra", "stem"),
    ("anatomy", "stem"),
    ("astronomy", "stem"),
    ("business_ethics", "other"),
    ("clinical_knowledge", "other"),
    ("college_biology", "stem"),
    ("college_chemistry", "stem"),
    ("college_computer_science", "stem"),
    ("college_mathematics", "stem"),
    ("college_medicine", "other"),
    ("college_physics", "stem"),
    ("computer_security", "stem"),
    ("conceptual_physics", "stem"),
    ("econometrics", "social_sciences"),
    ("electrical_engineering", "stem"),
    ("elementary_mathematics", "stem"),
    ("formal_logic", "humanities"),
    ("global_facts", "other"),
    ("high_school_biology", "stem"),
    ("high_school_chemistry", "stem"),
    ("high_school_computer_science", "stem"),
    ("high_school_european_history", "humanities"),
    ("high_school_geography", "social_sciences"),
    ("high_school_government_and_politics", "social_sciences"),
    ("high_school_macroeconomics", "social_sciences"),
    ("high_school_mathematics", "stem"),
    ("high_school_microeconomics", "social_sciences"),
    ("high_school_physics", "stem"),
    ("high_school_psychology", "social_sciences"),
    ("high_school_statistics", "stem"),
    ("high_school_us_history", "humanities"),
    ("high_school_world_history", "humanities"),
    ("human_aging", "other"),
    ("human_sexuality", "social_sciences"),
    ("international_law", "humanities"),
    ("jurisprudence", "humanities"),
    ("logical_fallacies", "humanities"),
    ("machine_learning", "stem"),
    ("management", "other"),
    ("marketing", "other"),
    ("medical_genetics", "other"),
    ("miscellaneous", "other"),
    ("moral_disputes", "humanities"),
    ("moral_scenarios", "humanities"),
    ("nutrition", "other"),
    ("philosophy", "humanities"),
    ("prehistory", "humanities"),
    ("professional_accounting", "other"),
    ("professional_law", "humanities"),
    ("professional_medicine", "other"),
    ("professional_psychology", "social_sciences"),
    ("public_relations", "social_sciences"),
    ("security_studies", "social_sciences"),
    ("sociology", "social_sciences"),
    ("us_foreign_policy", "social_sciences"),
    ("virology", "other"),
    ("world_religions", "humanities"),
];

/// The harness group of a subject.
pub fn group_of(subject: &str) -> Option<&'static str> {
    SUBJECTS
        .iter()
        .find(|(s, _)| *s == subject)
        .map(|(_, g)| *g)
}

/// One question.
struct Question {
    question: String,
    choices: [String; 4],
    answer: usize,
}

impl Question {
    /// The harness's `doc_to_text`.
    fn text(&self) -> String {
        let c = &self.choices;
        format!(
            "{}\nA. {}\nB. {}\nC. {}\nD. {}\nAnswer:",
            self.question.trim(),
            c[0],
            c[1],
            c[2],
            c[3]
        )
    }
}

const LETTERS: [&str; 4] = ["A", "B", "C", "D"];

fn letter_index(s: &str, at: &dyn std::fmt::Display) -> Result<usize> {
    LETTERS
        .iter()
        .position(|l| *l == s.trim())
        .ok_or_else(|| anyhow!("{at}: answer {s:?} is not one of A, B, C, D"))
}

/// Questions by subject and split ("dev", "val", "test").
type Splits = BTreeMap<String, BTreeMap<String, Vec<Question>>>;

fn read_csv(path: &Path, out: &mut Vec<Question>) -> Result<()> {
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(false)
        .flexible(false)
        .from_path(path)
        .with_context(|| format!("opening {}", path.display()))?;
    for (i, row) in reader.records().enumerate() {
        let at = format!("{}:row {}", path.display(), i + 1);
        let row = row.with_context(|| at.clone())?;
        if row.len() != 6 {
            bail!(
                "{at}: {} columns, expected 6 (question, A, B, C, D, answer)",
                row.len()
            );
        }
        out.push(Question {
            question: row[0].to_string(),
            choices: [1, 2, 3, 4].map(|c| row[c].to_string()),
            answer: letter_index(&row[5], &at)?,
        });
    }
    Ok(())
}

/// The original tree: `{split}/{subject}_{split}.csv`.
fn read_csv_tree(dir: &Path) -> Result<Splits> {
    let mut splits = Splits::new();
    for split in ["dev", "val", "test"] {
        let Ok(entries) = std::fs::read_dir(dir.join(split)) else {
            continue;
        };
        let mut files: Vec<PathBuf> = entries.filter_map(|e| Some(e.ok()?.path())).collect();
        files.sort();
        for f in files {
            let name = f.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            let Some(subject) = name.strip_suffix(&format!("_{split}.csv")) else {
                continue;
            };
            let questions = splits
                .entry(subject.to_string())
                .or_default()
                .entry(split.to_string())
                .or_default();
            read_csv(&f, questions)?;
        }
    }
    Ok(splits)
}

fn record_question(r: &Record) -> Result<(String, Question)> {
    let choices = r
        .fields
        .get("choices")
        .and_then(Json::as_array)
        .filter(|c| c.len() == 4)
        .ok_or_else(|| anyhow!("{}: \"choices\" is not a list of 4", r.loc))?;
    let choices = [0, 1, 2, 3].map(|i| choices[i].as_str().unwrap_or_default().to_string());
    let answer = match r.fields.get("answer") {
        Some(Json::Number(n)) if n.as_u64().is_some_and(|a| a < 4) => {
            n.as_u64().unwrap_or(0) as usize
        }
        Some(Json::String(s)) => letter_index(s, &r.loc)?,
        _ => bail!("{}: \"answer\" is not 0-3 or A-D", r.loc),
    };
    let question = Question {
        question: text_field(r, "question")?.to_string(),
        choices,
        answer,
    };
    Ok((text_field(r, "subject")?.to_string(), question))
}

/// The HF layout: data files whose names start with their split.
fn read_hf_layout(dir: &Path) -> Result<Splits> {
    let mut splits = Splits::new();
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).with_context(|| format!("reading {}", d.display()))? {
            let p = e?.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                files.push(p);
            }
        }
    }
    files.sort();
    for f in files {
        let name = f.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        let split = ["dev", "validation", "test"]
            .into_iter()
            .find(|s| name.starts_with(s));
        let data = [".parquet", ".jsonl", ".json"]
            .iter()
            .any(|x| name.ends_with(x));
        let (Some(split), true) = (split, data) else {
            continue;
        };
        let split = if split == "validation" { "val" } else { split };
        for r in read_records(&f)? {
            let (subject, q) = record_question(&r)?;
            splits
                .entry(subject)
                .or_default()
                .entry(split.into())
                .or_default()
                .push(q);
        }
    }
    Ok(splits)
}

/// The documents of every subject (subjects in name order), with `num_fewshot` (default 5)
/// dev shots each.
pub fn load(dir: &Path, num_fewshot: Option<usize>) -> Result<Vec<ChoiceDoc>> {
    let shots = num_fewshot.unwrap_or(5);
    let splits = if dir.join("dev").is_dir() {
        read_csv_tree(dir)?
    } else {
        read_hf_layout(dir)?
    };
    if splits.is_empty() {
        bail!(
            "{}: no MMLU data (expected dev/ val/ test/ csv folders, or HF data files named \
             dev-*, validation-*, test-*)",
            dir.display()
        );
    }
    let mut docs = Vec::new();
    for (subject, by_split) in &splits {
        if group_of(subject).is_none() {
            bail!("{}: unknown MMLU subject {subject:?}", dir.display());
        }
        let eval = by_split
            .get("test")
            .or_else(|| by_split.get("val"))
            .ok_or_else(|| anyhow!("{}: {subject} has no test or val split", dir.display()))?;
        let dev = by_split.get("dev").map(Vec::as_slice).unwrap_or_default();
        if dev.len() < shots {
            bail!(
                "{}: {subject} has {} dev rows, fewer than --num-fewshot {shots}",
                dir.display(),
                dev.len()
            );
        }
        let mut prefix = format!(
            "The following are multiple choice questions (with answers) about {}.\n\n",
            subject.replace('_', " ")
        );
        for q in &dev[..shots] {
            prefix += &format!("{} {}\n\n", q.text(), LETTERS[q.answer]);
        }
        docs.extend(eval.iter().map(|q| ChoiceDoc {
            context: format!("{prefix}{}", q.text()),
            choices: LETTERS.iter().map(|l| format!(" {l}")).collect(),
            gold: q.answer,
            subject: Some(subject.clone()),
        }));
    }
    Ok(docs)
}
