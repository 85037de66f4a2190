//! GSM8K as the harness's two tasks (`docs/evaluation.md` §3.2):
//! - `gsm8k_cot`: Wei et al.'s 8 fixed exemplars (`"Q: {question}\nA: {reasoning} The answer is
//!   N.\n\n"`), then `"Q: {question}\nA:"`; stops at `Q:`.
//! - `gsm8k`: 5 shots drawn from the train split per question, in document order, by
//!   `random.Random(1234).sample` (`PyRandom`), rendered `"Question: {q}\nAnswer: {solution}\n\n"`,
//!   then `"Question: {question}\nAnswer:"`; stops at `Question:`.
//!
//! Both generate greedily up to 256 tokens (also stopping at `</s>`, `<|im_end|>` or EOS), extract
//! the answer by the `strict-match` and `flexible-extract` filters and compare it with the `####`
//! number after the harness's normalisation (case, commas, `$`, a final period).

use super::pyrandom::PyRandom;
use super::{read_records, text_field};
use crate::data::source::Record;
use anyhow::{bail, Result};
use regex::Regex;
use std::path::Path;
use std::sync::LazyLock;

/// The exemplars of the harness's `gsm8k-cot.yaml` (Wei et al. 2022, table 20).
const EXEMPLARS: [(&str, &str); 8] = [
    (
        "There are 15 trees in the grove. Grove workers will plant trees in the grove today. \
         After they are done, there will be 21 trees. How many trees did the grove workers plant \
         today?",
        "There are 15 trees originally. Then there were 21 trees after some more were planted. \
         So there must have been 21 - 15 = 6. The answer is 6.",
    ),
    (
        "If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the \
         parking lot?",
        "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. The answer is 5.",
    ),
    (
        "Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they \
         have left in total?",
        "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = \
         74. After eating 35, they had 74 - 35 = 39. The answer is 39.",
    ),
    (
        "Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How \
         many lollipops did Jason give to Denny?",
        "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave \
         Denny 20 - 12 = 8. The answer is 8.",
    ),
    (
        "Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many \
         toys does he have now?",
        "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 \
         more toys. 5 + 4 = 9. The answer is 9.",
    ),
    (
        "There were nine computers in the server room. Five more computers were installed each \
         day, from monday to thursday. How many computers are now in the server room?",
        "There were originally 9 computers. For each of 4 days, 5 more computers were added. So \
         5 * 4 = 20 computers were added. 9 + 20 is 29. The answer is 29.",
    ),
    (
        "Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 \
         more. How many golf balls did he have at the end of wednesday?",
        "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. \
         After losing 2 more, he had 35 - 2 = 33 golf balls. The answer is 33.",
    ),
    (
        "Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
        "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she \
         has 23 - 15 dollars left. 23 - 15 is 8. The answer is 8.",
    ),
];

/// New tokens at most (the harness's `max_gen_toks`).
pub const MAX_NEW_TOKENS: usize = 256;
/// The harness's default few-shot seed (`fewshot_random_seed`).
pub const FEWSHOT_SEED: u64 = 1234;

/// How the shots are chosen.
#[derive(Debug, Clone, Copy)]
pub struct FewShot<'a> {
    /// Shots per question (the variant's default when `None`).
    pub num: Option<usize>,
    /// `gsm8k`'s train split (default: `train.jsonl` beside the data).
    pub data: Option<&'a Path>,
    /// `gsm8k`'s sampler seed (the harness's `--seed`, fourth value; default 1234).
    pub seed: u64,
}

impl Default for FewShot<'_> {
    fn default() -> Self {
        FewShot {
            num: None,
            data: None,
            seed: FEWSHOT_SEED,
        }
    }
}

/// Which of the harness's GSM8K tasks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// `gsm8k`: random train-split shots, full solutions as targets.
    Standard,
    /// `gsm8k_cot`: the 8 fixed chain-of-thought exemplars.
    Cot,
}

impl Variant {
    /// Generation stops at these (and at EOS).
    pub fn stop(self) -> [&'static str; 3] {
        match self {
            Variant::Standard => ["Question:", "</s>", "<|im_end|>"],
            Variant::Cot => ["Q:", "</s>", "<|im_end|>"],
        }
    }

    /// Shots unless `--num-fewshot` says otherwise.
    pub fn default_shots(self) -> usize {
        match self {
            Variant::Standard => 5,
            Variant::Cot => EXEMPLARS.len(),
        }
    }

    /// `strict-match`: the first answer in the task's own format.
    pub fn strict_match(self, generation: &str) -> String {
        let re = match self {
            Variant::Standard => &*STRICT_STANDARD,
            Variant::Cot => &*STRICT_COT,
        };
        re.captures(generation)
            .and_then(|c| c.get(1))
            .map_or(INVALID.to_string(), |m| m.as_str().trim().to_string())
    }
}

/// A solved problem: its question and its `answer` text.
fn problem(r: &Record) -> Result<(String, String)> {
    Ok((
        text_field(r, "question")?.to_string(),
        text_field(r, "answer")?.to_string(),
    ))
}

/// The number after `####` of a GSM8K solution.
fn final_number(answer: &str) -> String {
    answer
        .rsplit("####")
        .next()
        .unwrap_or(answer)
        .trim()
        .to_string()
}

/// A GSM8K question with its prompt and reference answer.
#[derive(Debug, Clone)]
pub struct GenDoc {
    /// The prompt (exemplars + question).
    pub context: String,
    /// The reference number (after `####`).
    pub target: String,
}

/// The questions of a GSM8K file (`question`, `answer` ending in `#### N`) with their prompts.
pub fn load(path: &Path, variant: Variant, few: FewShot) -> Result<Vec<GenDoc>> {
    let shots = few.num.unwrap_or(variant.default_shots());
    let problems: Vec<(String, String)> = read_records(path)?
        .iter()
        .map(problem)
        .collect::<Result<_>>()?;
    let contexts: Vec<String> = match variant {
        Variant::Cot => {
            if shots > EXEMPLARS.len() {
                bail!(
                    "gsm8k-cot has {} exemplars; --num-fewshot {shots} is too many",
                    EXEMPLARS.len()
                );
            }
            let prefix: String = EXEMPLARS[..shots]
                .iter()
                .map(|(q, a)| format!("Q: {q}\nA: {a}\n\n"))
                .collect();
            problems
                .iter()
                .map(|(q, _)| format!("{prefix}Q: {q}\nA:"))
                .collect()
        }
        Variant::Standard => {
            let train = shot_pool(path, few.data, shots)?;
            let mut rnd = PyRandom::new(few.seed);
            problems
                .iter()
                .map(|(q, _)| {
                    let shown: String = rnd
                        .sample(train.len(), shots)
                        .into_iter()
                        .map(|i| format!("Question: {}\nAnswer: {}\n\n", train[i].0, train[i].1))
                        .collect();
                    format!("{shown}Question: {q}\nAnswer:")
                })
                .collect()
        }
    };
    Ok(contexts
        .into_iter()
        .zip(&problems)
        .map(|(context, (_, answer))| GenDoc {
            context,
            target: final_number(answer),
        })
        .collect())
}

/// The train split `gsm8k` samples shots from, in file order.
fn shot_pool(
    path: &Path,
    fewshot_data: Option<&Path>,
    shots: usize,
) -> Result<Vec<(String, String)>> {
    let train = match fewshot_data {
        Some(p) => p.to_path_buf(),
        None => path.parent().unwrap_or(Path::new(".")).join("train.jsonl"),
    };
    if !train.exists() {
        bail!(
            "gsm8k draws its {shots} shots from the train split, and {} does not exist; \
             pass --fewshot-data TRAIN.jsonl",
            train.display()
        );
    }
    let pool: Vec<(String, String)> = read_records(&train)?
        .iter()
        .map(problem)
        .collect::<Result<_>>()?;
    if pool.len() < shots {
        bail!(
            "{} holds {} problems, fewer than {shots} shots",
            train.display(),
            pool.len()
        );
    }
    Ok(pool)
}

static STRICT_COT: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"The answer is (\-?[0-9\.\,]+).").expect("valid regex"));
static STRICT_STANDARD: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"#### (\-?[0-9\.\,]+)").expect("valid regex"));
static FLEXIBLE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(-?[$0-9.,]{2,})|(-?[0-9]+)").expect("valid regex"));
static IGNORED: LazyLock<[Regex; 4]> = LazyLock::new(|| {
    [",", r"\$", r"(?s).*#### ", r"\.$"].map(|r| Regex::new(r).expect("valid regex"))
});

const INVALID: &str = "[invalid]";

/// `flexible-extract`: the last number-like run in the text.
pub fn flexible_extract(generation: &str) -> String {
    FLEXIBLE
        .captures_iter(generation)
        .last()
        .and_then(|c| c.get(1).or_else(|| c.get(2)))
        .map_or(INVALID.to_string(), |m| m.as_str().trim().to_string())
}

fn normalise(s: &str) -> String {
    IGNORED
        .iter()
        .fold(s.to_string(), |t, r| r.replace_all(&t, "").into_owned())
        .to_lowercase()
}

/// The harness's `exact_match` with gsm8k's `regexes_to_ignore` and `ignore_case`.
pub fn exact_match(prediction: &str, target: &str) -> bool {
    normalise(prediction) == normalise(target)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_and_normalisation_follow_the_harness() {
        let g = "She has 3 + 4 = 7 apples. The answer is 1,234.\n\nQ";
        assert_eq!(Variant::Cot.strict_match(g), "1,234");
        assert_eq!(
            Variant::Standard.strict_match("5 + 2 = 7\n#### 7\n\nQuestion"),
            "7"
        );
        assert_eq!(flexible_extract(g), "1,234.");
        assert!(exact_match(&flexible_extract(g), "1234"));
        assert_eq!(Variant::Cot.strict_match("no number here"), INVALID);
        assert_eq!(Variant::Standard.strict_match("The answer is 7."), INVALID);
        assert_eq!(flexible_extract("It costs $5 or 7"), "7");
        assert_eq!(flexible_extract("It costs $5"), "$5");
        assert!(exact_match("$5", "5"));
        assert!(!exact_match(INVALID, "5"));
    }
}
