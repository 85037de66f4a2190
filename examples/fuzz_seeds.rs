//! Write the seed corpora of the fuzz targets (`fuzz/`) from `fixtures/`:
//! `cargo run --example fuzz_seeds -- fixtures fuzz/corpus` writes `fuzz/corpus/<target>/<name>`
//! for every seed of [`mindkit::fuzzing::seeds`]. `fuzz/seed.sh` runs it.

use std::path::PathBuf;

fn main() -> std::io::Result<()> {
    let args: Vec<PathBuf> = std::env::args_os().skip(1).map(PathBuf::from).collect();
    let [fixtures, corpus] = args.as_slice() else {
        eprintln!("usage: fuzz_seeds FIXTURES_DIR CORPUS_DIR");
        std::process::exit(2);
    };
    let seeds = mindkit::fuzzing::seeds(fixtures)?;
    for s in &seeds {
        let dir = corpus.join(s.target);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join(&s.name), &s.bytes)?;
    }
    let count = |t: &str| seeds.iter().filter(|s| s.target == t).count();
    for target in ["pickle", "safetensors_config", "idx", "records"] {
        println!("{target}: {} seeds", count(target));
    }
    Ok(())
}
