//! Re-save a `.pt` file through mindkit's safe reader and its writer:
//! `cargo run --release --example pt_copy -- IN.pt OUT.pt`. The interop tests load the copy
//! with `torch.load` to check the writer.

use mindkit::ckpt::torch::pickle::{StorageRef, Value};
use mindkit::ckpt::torch::save::PtWriter;
use mindkit::ckpt::torch::TorchFile;
use std::collections::BTreeMap;

/// Every storage the object's tensors use, by key, with the name of one tensor using it.
fn storages(v: &Value, name: &str, out: &mut BTreeMap<String, (String, StorageRef)>) {
    match v {
        Value::Tensor(t) => {
            out.entry(t.storage.key.clone())
                .or_insert_with(|| (name.to_string(), t.storage.clone()));
        }
        Value::Dict(items) => {
            for (k, v) in items {
                let key = match k {
                    Value::Str(s) => s.clone(),
                    other => format!("{other:?}"),
                };
                storages(v, &key, out);
            }
        }
        Value::Namespace(attrs) => attrs.iter().for_each(|(k, v)| storages(v, k, out)),
        Value::List(items) | Value::Tuple(items) => {
            items.iter().for_each(|v| storages(v, name, out))
        }
        _ => {}
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [input, output] = args.as_slice() else {
        anyhow::bail!("usage: pt_copy IN.pt OUT.pt");
    };
    let pt = TorchFile::open(input.as_ref())?;
    let mut used = BTreeMap::new();
    storages(pt.root(), "", &mut used);
    let mut keys: Vec<_> = used.into_iter().collect();
    // torch writes storages in numeric key order (.format_version 1).
    keys.sort_by_key(|(k, _)| k.parse::<u64>().unwrap_or(u64::MAX));
    let mut w = PtWriter::create(output.as_ref(), pt.root(), true)?;
    for (key, (name, storage)) in keys {
        w.write_storage(&key, pt.storage_bytes(&name, &storage)?)?;
    }
    w.finish()?;
    Ok(())
}
