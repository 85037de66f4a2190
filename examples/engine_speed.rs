//! Engine throughput for scripts/bench-eval.sh, on token sequences the transformers side
//! builds by the same formula: `engine_speed MODEL_DIR DOCS CONTEXT_LEN DECODE_STEPS`.
//! Prints JSON lines: prefill (loglikelihood-style: every context run at batch 1, logits of
//! its last row), decode (greedy, KV cache), and the machine's copy bandwidth with the same
//! threads, from which the decode bound follows.

use anyhow::Result;
use mindkit::engine::cpu::Cpu;
use mindkit::engine::{Backend, Device};
use mindkit::model::generate::argmax;
use mindkit::model::{Model, Step};
use rayon::prelude::*;
use std::path::PathBuf;
use std::time::Instant;

// The allocator the mindkit binary uses, so that the numbers are the binary's.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Token `j` of document `i` (the transformers script uses the same formula).
fn token(i: usize, j: usize, vocab: usize) -> u32 {
    ((i * 7919 + j * 104_729 + 13) % vocab) as u32
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Bytes read per second by a parallel copy of a 512 MiB buffer (median of 5).
fn copy_bandwidth() -> f64 {
    let src = vec![1f32; 128 << 20];
    let mut dst = vec![0f32; src.len()];
    let runs = (0..5)
        .map(|_| {
            let t = Instant::now();
            dst.par_chunks_mut(1 << 16)
                .zip(src.par_chunks(1 << 16))
                .for_each(|(d, s)| d.copy_from_slice(s));
            (src.len() * 4) as f64 / t.elapsed().as_secs_f64()
        })
        .collect();
    median(runs)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [dir, docs, len, steps] = &args[..] else {
        anyhow::bail!("usage: engine_speed MODEL_DIR DOCS CONTEXT_LEN DECODE_STEPS");
    };
    let (docs, len, steps): (usize, usize, usize) = (docs.parse()?, len.parse()?, steps.parse()?);
    let model = Model::load(&Cpu, &PathBuf::from(dir))?;
    let vocab = model.spec.vocab;
    let start = Instant::now();
    for i in 0..docs {
        let ids: Vec<u32> = (0..len).map(|j| token(i, j, vocab)).collect();
        let mut cache = model.cache(1, len)?;
        let step = Step {
            slot: 0,
            past: 0,
            tokens: &ids,
        };
        Cpu.download_f32(&Cpu.log_softmax(&model.forward(&mut cache, &[step], &[len - 1])?)?)?;
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        r#"{{"what": "prefill", "tokens_per_s": {}}}"#,
        (docs * len) as f64 / secs
    );
    let prompt: Vec<u32> = (0..8).map(|j| token(docs, j, vocab)).collect();
    let mut cache = model.cache(1, prompt.len() + steps)?;
    let first = Step {
        slot: 0,
        past: 0,
        tokens: &prompt,
    };
    let mut next = argmax(&Cpu.download_f32(&model.forward(&mut cache, &[first], &[7])?)?) as u32;
    let start = Instant::now();
    for i in 0..steps {
        let step = Step {
            slot: 0,
            past: prompt.len() + i,
            tokens: &[next],
        };
        next = argmax(&Cpu.download_f32(&model.forward(&mut cache, &[step], &[0])?)?) as u32;
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        r#"{{"what": "decode", "tokens_per_s": {}}}"#,
        steps as f64 / secs
    );
    println!(r#"{{"what": "copy", "bytes_per_s": {}}}"#, copy_bandwidth());
    Ok(())
}
