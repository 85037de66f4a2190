//! `mindkit lora merge` / `lora info` against the goldens in fixtures/lora (made by
//! fixtures/gen/make_lora_fixtures.py with peft's `merge_and_unload`): PEFT adapters (plain,
//! modules_to_save, rsLoRA + rank/alpha patterns + embedding LoRA, lora_bias), the same adapter
//! as a Megatron TP2/PP2 LoRA checkpoint, every base/adapter/output format combination, and bad
//! input that must fail without writing anything.

mod common;

use common::{convert, copy_dir, fixture, leftovers, mindkit as run};
use common::{lora_merge as merge, lora_merge_err as merge_err};
use mindkit::ckpt::hf::HfWeights;
use mindkit::tensor::host::to_f32;
use mindkit::tensor::DType;
use std::path::Path;

/// Every tensor of the HF directory `dir` is within `tol` of the golden safetensors file.
fn assert_matches_golden(dir: &Path, golden: &Path, tol: f32) {
    let got = HfWeights::open(dir).unwrap();
    let want = HfWeights::open_files(vec![golden.to_path_buf()]).unwrap();
    let names: Vec<_> = want.entries().keys().collect();
    assert_eq!(got.entries().keys().collect::<Vec<_>>(), names);
    for n in names {
        let (a, b) = (got.read(n).unwrap(), want.read(n).unwrap());
        assert_eq!(a.shape, b.shape, "{n}");
        let (a, b) = (to_f32(&a).unwrap(), to_f32(&b).unwrap());
        let diff = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(diff <= tol, "{}: {n} differs by {diff}", dir.display());
    }
}

const PEFT_CASES: &[(&str, &str)] = &[
    ("llama", "llama"),
    ("llama-save", "llama"),
    ("mistral-rslora", "mistral"),
    ("qwen2-bias", "qwen2"),
];

#[test]
fn peft_adapters_merge_like_peft() {
    let tmp = tempfile::tempdir().unwrap();
    for (case, family) in PEFT_CASES {
        let out = tmp.path().join(case);
        let base = fixture(&format!("models/{family}"));
        merge(&base, &fixture(&format!("lora/{case}")), &out, &[]).success();
        assert_matches_golden(
            &out,
            &fixture(&format!("lora/{case}/merged.safetensors")),
            1e-6,
        );
        let cfg = |d: &Path| -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap()
        };
        assert_eq!(cfg(&out), cfg(&base), "{case}: config.json changed");
    }
}

#[test]
fn fan_in_fan_out_is_ignored_on_linear_layers_as_peft_does() {
    let tmp = tempfile::tempdir().unwrap();
    let adapter = tmp.path().join("adapter");
    std::fs::create_dir(&adapter).unwrap();
    for file in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(fixture(&format!("lora/llama/{file}")), adapter.join(file)).unwrap();
    }
    let config_path = adapter.join("adapter_config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["fan_in_fan_out"] = true.into();
    std::fs::write(&config_path, config.to_string()).unwrap();
    let out = tmp.path().join("merged");
    merge(&fixture("models/llama"), &adapter, &out, &[]).success();
    assert_matches_golden(&out, &fixture("lora/llama/merged.safetensors"), 1e-6);
}

#[test]
fn megatron_lora_merges_into_any_base_format() {
    let tmp = tempfile::tempdir().unwrap();
    let t = |n: &str| tmp.path().join(n);
    let golden = fixture("lora/llama/merged.safetensors");
    let (meg_adapter, peft_adapter) =
        (fixture("lora/llama-megatron-tp2pp2"), fixture("lora/llama"));
    // HF base + Megatron TP2/PP2 adapter → HF.
    merge(
        &fixture("models/llama"),
        &meg_adapter,
        &t("hf"),
        &["--to", "hf"],
    )
    .success();
    assert_matches_golden(&t("hf"), &golden, 1e-6);
    // Megatron base of another layout (TP1 PP4) + the TP2/PP2 adapter → Megatron TP2 → HF.
    convert(
        "megatron",
        &fixture("models/llama"),
        &t("base"),
        &["--pp", "4"],
    );
    merge(
        &t("base"),
        &meg_adapter,
        &t("m"),
        &["--tp", "2", "--pp", "1"],
    )
    .success();
    convert("hf", &t("m"), &t("m-hf"), &[]);
    assert_matches_golden(&t("m-hf"), &golden, 1e-6);
    // Megatron base + PEFT adapter → HF.
    merge(&t("base"), &peft_adapter, &t("p-hf"), &["--to", "hf"]).success();
    assert_matches_golden(&t("p-hf"), &golden, 1e-6);
    // torch_dist base (written from the TP1 PP4 one) + PEFT adapter → torch_dist → HF.
    convert(
        "megatron",
        &t("base"),
        &t("dist"),
        &["--ckpt-format", "torch_dist"],
    );
    let to_dist = ["--to", "megatron", "--ckpt-format", "torch_dist"];
    merge(&t("dist"), &peft_adapter, &t("d"), &to_dist).success();
    convert("hf", &t("d"), &t("d-hf"), &[]);
    assert_matches_golden(&t("d-hf"), &golden, 1e-6);
}

#[test]
fn output_dtype_and_reshard_follow_the_options() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("bf16");
    let adapter = fixture("lora/llama");
    merge(
        &fixture("models/llama"),
        &adapter,
        &out,
        &["--dtype", "bf16"],
    )
    .success();
    let w = HfWeights::open(&out).unwrap();
    assert!(w.entries().values().all(|e| e.dtype == DType::BF16));
    // f32 merge then one rounding: within bf16's half-ulp of the golden.
    assert_matches_golden(&out, &fixture("lora/llama/merged.safetensors"), 4e-3);
    let meg = tmp.path().join("meg");
    merge(
        &fixture("models/llama"),
        &adapter,
        &meg,
        &["--to", "megatron", "--tp", "2", "--pp", "2"],
    )
    .success();
    assert!(meg
        .join("iter_0000001/mp_rank_01_001/model_optim_rng.pt")
        .is_file());
}

/// A deterministic pseudo-random f32 tensor in [-0.5, 0.5).
fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

type Named = (String, Vec<usize>, Vec<f32>);

fn write_adapter(dir: &Path, config: serde_json::Value, tensors: &[Named]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("adapter_config.json"), config.to_string()).unwrap();
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, s, v)| {
            (
                n.to_string(),
                s.clone(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = bytes
        .iter()
        .map(|(n, s, b)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b);
            (n.clone(), view.unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("adapter_model.safetensors")).unwrap();
}

#[test]
fn baichuan_w_pack_gets_the_plain_product() {
    // W_pack rows are [q; k; v] in HF: the merged W_pack must be W + s·B·A row for row, although
    // mindkit merges in Megatron's grouped order.
    let tmp = tempfile::tempdir().unwrap();
    let (r, rows, cols) = (3usize, 96usize, 32usize);
    let (a, b) = (noise(r * cols, 1), noise(rows * r, 2));
    let key = "base_model.model.model.layers.2.self_attn.W_pack";
    let adapter = tmp.path().join("adapter");
    write_adapter(
        &adapter,
        serde_json::json!({"peft_type": "LORA", "r": r, "lora_alpha": 6, "target_modules": ["W_pack"]}),
        &[
            (format!("{key}.lora_A.weight"), vec![r, cols], a.clone()),
            (format!("{key}.lora_B.weight"), vec![rows, r], b.clone()),
        ],
    );
    let out = tmp.path().join("out");
    merge(&fixture("models/baichuan"), &adapter, &out, &[]).success();
    let name = "model.layers.2.self_attn.W_pack.weight";
    let base = HfWeights::open(&fixture("models/baichuan")).unwrap();
    let w0 = to_f32(&base.read(name).unwrap()).unwrap();
    let w1 = to_f32(&HfWeights::open(&out).unwrap().read(name).unwrap()).unwrap();
    for i in 0..rows {
        for j in 0..cols {
            let d: f32 = (0..r).map(|k| b[i * r + k] * a[k * cols + j]).sum();
            let want = w0[i * cols + j] + 2.0 * d;
            assert!((w1[i * cols + j] - want).abs() < 1e-6, "row {i} col {j}");
        }
    }
}

#[test]
fn bad_adapters_are_refused_before_writing() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let llama = fixture("models/llama");
    let bad = |name: &str, config: serde_json::Value, tensors: &[Named]| {
        let d = tmp.path().join(name);
        write_adapter(&d, config, tensors);
        d
    };
    let cfg = serde_json::json!({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]});
    let pair = |module: &str, rows: usize, cols: usize| -> Vec<Named> {
        let m = format!("base_model.model.model.layers.0.self_attn.{module}");
        vec![
            (
                format!("{m}.lora_A.weight"),
                vec![2, cols],
                noise(2 * cols, 3),
            ),
            (
                format!("{m}.lora_B.weight"),
                vec![rows, 2],
                noise(rows * 2, 4),
            ),
        ]
    };
    let with = |key: &str, value: serde_json::Value| {
        let mut c = cfg.clone();
        c[key] = value;
        c
    };
    let mut no_r = cfg.clone();
    no_r.as_object_mut().unwrap().remove("r");
    let cases = [
        (
            bad("shape", cfg.clone(), &pair("q_proj", 32, 48)),
            "do not fit the base tensor",
        ),
        (
            bad("no-r", no_r, &pair("q_proj", 32, 32)),
            "missing or non-numeric \"r\"",
        ),
        (
            bad(
                "dora",
                with("use_dora", true.into()),
                &pair("q_proj", 32, 32),
            ),
            "DoRA adapters",
        ),
        (
            bad(
                "ia3",
                with("peft_type", "IA3".into()),
                &pair("q_proj", 32, 32),
            ),
            "only LORA",
        ),
        (
            bad("half", cfg.clone(), &pair("q_proj", 32, 32)[..1]),
            "has lora_A but no lora_B",
        ),
        (
            bad("unknown", cfg.clone(), &pair("rotary", 32, 32)),
            "unknown target module",
        ),
    ];
    for (adapter, want) in cases {
        let err = merge_err(&llama, &adapter, &out, &[]);
        assert!(err.contains(want), "{}: {err}", adapter.display());
        assert!(!out.exists() && leftovers(tmp.path()).is_empty());
    }
    // An adapter for another architecture: baichuan has W_pack, not q_proj.
    let err = merge_err(
        &fixture("models/baichuan"),
        &fixture("lora/llama"),
        &out,
        &[],
    );
    assert!(err.contains("unknown target module"), "{err}");
    // A Megatron adapter whose args lack lora_alpha needs --lora-alpha.
    let meg = tmp.path().join("meg");
    copy_dir(&fixture("lora/llama-megatron-tp2pp2"), &meg);
    strip_alpha(&meg);
    let err = merge_err(&llama, &meg, &out, &[]);
    assert!(err.contains("--lora-alpha"), "{err}");
    merge(&llama, &meg, &out, &["--lora-alpha", "24"]).success();
    assert_matches_golden(&out, &fixture("lora/llama/merged.safetensors"), 1e-6);
    // The output exists now: refused without --force, replaced with it.
    let err = merge_err(&llama, &fixture("lora/llama"), &out, &[]);
    assert!(err.contains("--force"), "{err}");
    merge(&llama, &fixture("lora/llama-save"), &out, &["--force"]).success();
    assert_matches_golden(&out, &fixture("lora/llama-save/merged.safetensors"), 1e-6);
}

/// Rewrite every rank file of a Megatron LoRA checkpoint without `args.lora_alpha`.
fn strip_alpha(ck: &Path) {
    use mindkit::ckpt::torch::pickle::Value;
    use mindkit::ckpt::torch::save::PtWriter;
    use mindkit::ckpt::torch::TorchFile;
    for p in 0..2 {
        for t in 0..2 {
            let path = ck.join(format!(
                "iter_0000001/mp_rank_{t:02}_{p:03}/model_optim_rng.pt"
            ));
            let pt = TorchFile::open(&path).unwrap();
            let Value::Dict(mut root) = pt.root().clone() else {
                panic!()
            };
            for (k, v) in root.iter_mut() {
                if let (Value::Str(k), Value::Namespace(args)) = (k, v) {
                    assert_eq!(k, "args");
                    args.retain(|(n, _)| n != "lora_alpha");
                }
            }
            let root = Value::Dict(root);
            let mut tensors = Vec::new();
            collect_tensors(&root, &mut tensors);
            let tmp = path.with_extension("new");
            let mut w = PtWriter::create(&tmp, &root, false).unwrap();
            for t in tensors {
                let bytes = pt.storage_bytes("", &t.storage).unwrap();
                w.write_storage(&t.storage.key, bytes).unwrap();
            }
            w.finish().unwrap();
            std::fs::rename(tmp, path).unwrap();
        }
    }
}

fn collect_tensors(
    v: &mindkit::ckpt::torch::pickle::Value,
    out: &mut Vec<mindkit::ckpt::torch::pickle::TensorRef>,
) {
    use mindkit::ckpt::torch::pickle::Value;
    match v {
        Value::Tensor(t) => out.push((**t).clone()),
        Value::Dict(items) => items.iter().for_each(|(_, v)| collect_tensors(v, out)),
        _ => {}
    }
}

#[test]
fn lora_info_describes_both_kinds() {
    let out = run(&[&"lora", &"info", &fixture("lora/mistral-rslora")]).success();
    let text = String::from_utf8(out.get_output().stdout.clone()).unwrap();
    for want in [
        "PEFT LoRA adapter",
        "r: 4, lora_alpha: 16",
        "rsLoRA",
        "rank_pattern: k_proj: 2",
        "embed_tokens",
        "adapted modules: 29",
        "parameters: 9120 LoRA",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }
    let out = run(&[&"lora", &"info", &fixture("lora/llama-megatron-tp2pp2")]).success();
    let text = String::from_utf8(out.get_output().stdout.clone()).unwrap();
    for want in [
        "Megatron LoRA checkpoint",
        "TP 2, PP 2",
        "r: 12, lora_alpha: 24",
        "adapted modules: 16",
        "parameters: 19968",
        "LoRA-only",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }
}

#[test]
fn the_adapter_or_base_is_never_the_output() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, adapter) = (tmp.path().join("base"), tmp.path().join("adapter"));
    copy_dir(&fixture("models/llama"), &base);
    copy_dir(&fixture("lora/llama"), &adapter);
    let err = merge_err(&base, &adapter, &adapter, &["--force"]);
    assert!(err.contains("is the input"), "{err}");
    let err = merge_err(&base, &adapter, tmp.path(), &["--force"]);
    assert!(err.contains("contains the input"), "{err}");
    let err = merge_err(&base, &adapter, &base.join("merged"), &["--force"]);
    assert!(err.contains("lies inside the input"), "{err}");
    assert!(adapter.join("adapter_config.json").is_file());
    assert!(base.join("model.safetensors").is_file() && !base.join("merged").exists());
    assert!(leftovers(tmp.path()).is_empty());
}
