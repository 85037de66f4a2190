//! A short run of the fuzz targets' entry points ([`mindkit::fuzzing`]) inside `cargo test`:
//! every seed from `fixtures/`, arbitrary bytes, and seeds with bytes overwritten and cut.
//! The real fuzzers run for minutes (fuzz/README.md); this keeps the entry points and the
//! seeds working between those runs. An input may be refused; it must never panic.

use mindkit::fuzzing;
use proptest::prelude::*;
use std::path::Path;
use std::sync::OnceLock;

/// An entry point: whether it read the input.
type Entry = fn(&[u8]) -> bool;

const TARGETS: [(&str, Entry); 5] = [
    ("pickle", fuzzing::pickle),
    ("torch_dist", fuzzing::torch_dist),
    ("safetensors_config", fuzzing::safetensors_config),
    ("idx", fuzzing::idx),
    ("records", fuzzing::records),
];

/// The seeds of each target, in the order of [`TARGETS`].
fn seeds() -> &'static [Vec<Vec<u8>>] {
    static SEEDS: OnceLock<Vec<Vec<Vec<u8>>>> = OnceLock::new();
    SEEDS.get_or_init(|| {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures");
        let all = fuzzing::seeds(&fixtures).unwrap();
        TARGETS
            .iter()
            .map(|(t, _)| {
                (all.iter().filter(|s| s.target == *t))
                    .map(|s| s.bytes.clone())
                    .collect()
            })
            .collect()
    })
}

/// Inputs that crashed a fuzz target once (`fuzz/regressions/<target>/`), each fixed with a
/// test of its own beside the fix; here they all run through the targets again.
#[test]
fn fuzz_regressions_stay_fixed() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/regressions");
    let mut ran = 0;
    for (target, run) in TARGETS {
        let Ok(dir) = std::fs::read_dir(root.join(target)) else {
            continue;
        };
        for entry in dir {
            let _ = run(&std::fs::read(entry.unwrap().path()).unwrap());
            ran += 1;
        }
    }
    assert!(ran > 0, "no inputs under {}", root.display());
}

/// The seeds run, and most of them are read through (a fuzzer starting from refused inputs
/// would rarely reach the readers' depths).
#[test]
fn every_seed_runs() {
    for ((target, run), seeds) in TARGETS.iter().zip(seeds()) {
        let read = seeds.iter().filter(|s| run(s)).count();
        assert!(
            read >= 2 && read * 4 >= seeds.len() * 3,
            "{target}: {read} of {} seeds read",
            seeds.len()
        );
    }
}

/// Seed `pick` (modulo the count) of target `t` with `edits` (position modulo its length,
/// byte) written over it, cut to `keep` thousandths of its length when given.
fn mutated(t: usize, pick: usize, edits: &[(usize, u8)], keep: Option<usize>) -> Vec<u8> {
    let seeds = &seeds()[t];
    let mut bytes = seeds[pick % seeds.len()].clone();
    for &(at, b) in edits {
        if !bytes.is_empty() {
            let at = at % bytes.len();
            bytes[at] = b;
        }
    }
    if let Some(keep) = keep {
        bytes.truncate(bytes.len() * keep.min(1000) / 1000);
    }
    bytes
}

fn edits() -> impl Strategy<Value = Vec<(usize, u8)>> {
    proptest::collection::vec((any::<usize>(), any::<u8>()), 0..8)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn arbitrary_bytes_never_panic(t in 0usize..4, bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = TARGETS[t].1(&bytes);
    }

    #[test]
    fn mutated_seeds_never_panic(t in 0usize..4, pick: usize, e in edits(), keep in proptest::option::weighted(0.2, 0usize..1000)) {
        let _ = TARGETS[t].1(&mutated(t, pick, &e, keep));
    }
}
