//! Logits of a prompt and of greedy KV-cached decoding, for the interop tests to compare with
//! transformers: `cargo run --release --example logits -- MODEL_DIR IDS STEPS OUT.safetensors`
//! (IDS comma-separated). OUT holds `prefill` [P, V] (every prompt row), `steps` [STEPS, V]
//! and `generated` [STEPS] (i64: the argmax fed back at each step).

use anyhow::{Context, Result};
use mindkit::engine::cpu::Cpu;
use mindkit::engine::Device;
use mindkit::model::generate::argmax;
use mindkit::model::{Model, Step};
use safetensors::tensor::{Dtype, TensorView};
use std::path::PathBuf;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [model, ids, steps, out] = &args[..] else {
        anyhow::bail!("usage: logits MODEL_DIR IDS STEPS OUT.safetensors");
    };
    let prompt: Vec<u32> = ids.split(',').map(str::parse).collect::<Result<_, _>>()?;
    let steps: usize = steps.parse().context("STEPS")?;
    let model = Model::load(&Cpu, &PathBuf::from(model))?;
    let vocab = model.spec.vocab;
    let mut cache = model.cache(1, prompt.len() + steps)?;
    let rows: Vec<usize> = (0..prompt.len()).collect();
    let first = Step {
        slot: 0,
        past: 0,
        tokens: &prompt,
    };
    let prefill = Cpu.download_f32(&model.forward(&mut cache, &[first], &rows)?)?;
    let mut next = argmax(&prefill[prefill.len() - vocab..]) as u32;
    let (mut decoded, mut generated) = (Vec::new(), Vec::new());
    for i in 0..steps {
        generated.push(i64::from(next));
        let step = Step {
            slot: 0,
            past: prompt.len() + i,
            tokens: &[next],
        };
        let logits = Cpu.download_f32(&model.forward(&mut cache, &[step], &[0])?)?;
        next = argmax(&logits) as u32;
        decoded.extend(logits);
    }
    let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (prefill, decoded) = (bytes(&prefill), bytes(&decoded));
    let generated: Vec<u8> = generated.iter().flat_map(|x| x.to_le_bytes()).collect();
    let views = [
        (
            "prefill",
            TensorView::new(Dtype::F32, vec![prompt.len(), vocab], &prefill)?,
        ),
        (
            "steps",
            TensorView::new(Dtype::F32, vec![steps, vocab], &decoded)?,
        ),
        (
            "generated",
            TensorView::new(Dtype::I64, vec![steps], &generated)?,
        ),
    ];
    safetensors::serialize_to_file(views, None, out.as_ref())?;
    Ok(())
}
