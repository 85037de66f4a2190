//! `mindkit convert` / `ckpt info` on the tiny models in fixtures/models (made by
//! fixtures/gen/make_tiny_models.py with transformers): bit-exact round trips for every family
//! and layout, resharding, dtype casts, and bad input that must fail cleanly.

mod common;

use common::{convert, copy_dir, leftovers, mindkit, run_convert, run_with_umask_022};
use mindkit::ckpt::hf::HfWeights;
use mindkit::tensor::DType;
use std::path::{Path, PathBuf};

const FAMILIES: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "internlm",
    "baichuan",
    "aquila",
    "qwen3",
    "seed_oss",
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "glm4_moe",
    "deepseek_v3",
    "deepseek_v3_direct",
    "deepseek_v2",
];

fn model(name: &str) -> PathBuf {
    common::fixture(&format!("models/{name}"))
}

fn convert_err(to: &str, input: &Path, output: &Path, extra: &[&str]) -> String {
    let out = run_convert(to, input, output, extra)
        .code(1)
        .get_output()
        .clone();
    String::from_utf8(out.stderr).unwrap()
}

/// Same tensors (names, dtypes, shapes, bytes) and the same config.json.
fn assert_same_hf(a: &Path, b: &Path) {
    let (wa, wb) = (HfWeights::open(a).unwrap(), HfWeights::open(b).unwrap());
    let names: Vec<_> = wa.entries().keys().collect();
    assert_eq!(names, wb.entries().keys().collect::<Vec<_>>());
    for n in names {
        assert_eq!(wa.read(n).unwrap(), wb.read(n).unwrap(), "{n}");
    }
    let cfg = |d: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap()
    };
    assert_eq!(cfg(a), cfg(b));
}

fn rank_file(ck: &Path, rank: &str) -> PathBuf {
    ck.join("iter_0000001")
        .join(rank)
        .join("model_optim_rng.pt")
}

#[test]
fn every_family_round_trips_through_tp2_pp2() {
    let tmp = tempfile::tempdir().unwrap();
    for f in FAMILIES {
        let (m, h) = (tmp.path().join(format!("{f}-m")), tmp.path().join(f));
        convert("megatron", &model(f), &m, &["--tp", "2", "--pp", "2"]);
        for r in [
            "mp_rank_00_000",
            "mp_rank_01_000",
            "mp_rank_00_001",
            "mp_rank_01_001",
        ] {
            assert!(rank_file(&m, r).is_file(), "{f}: {r}");
        }
        assert_eq!(
            std::fs::read_to_string(m.join("latest_checkpointed_iteration.txt")).unwrap(),
            "1"
        );
        convert("hf", &m, &h, &[]);
        assert_same_hf(&model(f), &h);
    }
    // Tokenizer files travel with the weights both ways.
    assert!(tmp.path().join("llama/tokenizer.json").is_file());
}

#[test]
fn every_family_round_trips_through_torch_dist() {
    let tmp = tempfile::tempdir().unwrap();
    for f in FAMILIES.iter().chain(&["deepseek_v3_mtp"]) {
        let (d, h) = (tmp.path().join(format!("{f}-d")), tmp.path().join(f));
        let mut extra = vec!["--ckpt-format", "torch_dist"];
        if *f == "deepseek_v3_mtp" {
            extra.extend(["--mtp-layout", "mcore"]);
        }
        convert("megatron", &model(f), &d, &extra);
        let it = d.join("iter_0000001");
        for name in [".metadata", "__0_0.distcp", "common.pt", "metadata.json"] {
            assert!(it.join(name).is_file(), "{f}: {name}");
        }
        convert("hf", &d, &h, &[]);
        assert_same_hf(&model(f), &h);
    }
    // the args record the layout asked for; a torch_dist source reads back into torch_dist
    let (d2, d3) = (tmp.path().join("tp2"), tmp.path().join("again"));
    let extra = ["--ckpt-format", "torch_dist", "--tp", "2", "--pp", "2"];
    convert("megatron", &model("qwen3"), &d2, &extra);
    let info = mindkit(&[&"ckpt", &"info", &d2]).success();
    let info = String::from_utf8(info.get_output().stdout.clone()).unwrap();
    assert!(
        info.contains("torch_dist") && info.contains("TP 2 × PP 2"),
        "{info}"
    );
    convert("megatron", &d2, &d3, &["--ckpt-format", "torch_dist"]);
    convert("hf", &d3, &tmp.path().join("qwen3-again"), &[]);
    assert_same_hf(&model("qwen3"), &tmp.path().join("qwen3-again"));
    // grouped experts: megatron-core's GroupedMLP shards its weights expert by expert as
    // SequentialMLP does, so the data are the same, the args' moe_grouped_gemm set
    let [g, s, h] = ["grouped", "sequential", "grouped-hf"].map(|d| tmp.path().join(d));
    let dist = ["--ckpt-format", "torch_dist", "--ep", "2"];
    convert(
        "megatron",
        &model("mixtral"),
        &g,
        &[&dist[..], &["--moe-grouped-gemm"]].concat(),
    );
    convert("megatron", &model("mixtral"), &s, &dist);
    let data = |d: &Path| std::fs::read(d.join("iter_0000001/__0_0.distcp")).unwrap();
    assert!(
        data(&g) == data(&s),
        "grouped experts' torch_dist data differ"
    );
    let grouped = |d: &Path| {
        use mindkit::ckpt::torch::{pickle::Value, TorchFile};
        let pt = TorchFile::open(&d.join("iter_0000001/common.pt")).unwrap();
        let Some(Value::Namespace(args)) = pt.root().get("args") else {
            panic!("{}: no args", d.display());
        };
        (args.iter())
            .find_map(|(k, v)| (k == "moe_grouped_gemm").then_some(matches!(v, Value::Bool(true))))
    };
    assert_eq!((grouped(&g), grouped(&s)), (Some(true), Some(false)));
    convert("hf", &g, &h, &[]);
    assert_same_hf(&model("mixtral"), &h);
}

#[test]
fn torch_dist_refuses_the_layouts_megatron_core_does_not_load() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let cases: [(&str, &[&str], &str); 3] = [
        ("llama", &["--layout", "mcore-te"], "--layout mcore-te"),
        (
            "deepseek_v3",
            &["--mla-layout", "mindspeed"],
            "--mla-layout mindspeed",
        ),
        ("deepseek_v3_mtp", &[], "--mtp-layout mcore"),
    ];
    for (f, extra, named) in cases {
        let mut args = vec!["--ckpt-format", "torch_dist"];
        args.extend(extra);
        let err = convert_err("megatron", &model(f), &out, &args);
        assert!(err.contains(named), "{f}: {err}");
        assert!(!out.exists(), "{f}: output left behind");
    }
    let err = convert_err(
        "hf",
        &model("llama"),
        &out,
        &["--ckpt-format", "torch_dist"],
    );
    assert!(err.contains("a Megatron output's"), "{err}");
}

/// A rank file's model tensors: key → (shape, bytes), the keys of every model chunk but the
/// first prefixed `model{v}.`.
fn rank_tensors(path: &Path) -> std::collections::BTreeMap<String, (Vec<usize>, Vec<u8>)> {
    use mindkit::ckpt::megatron::{chunks, flatten};
    use mindkit::ckpt::torch::{pickle::Value, TorchFile};
    let pt = TorchFile::open(path).unwrap();
    let mut flat = std::collections::BTreeMap::new();
    for (v, chunk) in chunks(&pt).unwrap().into_iter().enumerate() {
        let mut one = Default::default();
        flatten(chunk, false, path, &mut one).unwrap();
        flat.extend(one.into_iter().map(|(k, t)| match v {
            0 => (k, t),
            _ => (format!("model{v}.{k}"), t),
        }));
    }
    (flat.into_iter())
        .filter_map(|(k, v)| match v {
            Value::Tensor(t) => {
                let t = pt.read_tensor(&k, &t).unwrap();
                Some((k, (t.shape, t.data)))
            }
            _ => None,
        })
        .collect()
}

/// Every layer's up projections of a `--mla-mm-split` rank file are the whole ones' rows of
/// each head (MindSpeed-LLM's convert_hf2mg.py: q_b_proj viewed `[heads, dn + dr, r]` and split
/// on its second dimension; kv_b_proj `[heads, dn + dv, r]` alike), with no whole one left.
fn assert_split_by_head(
    hf: &Path,
    whole: &std::collections::BTreeMap<String, (Vec<usize>, Vec<u8>)>,
    split: &std::collections::BTreeMap<String, (Vec<usize>, Vec<u8>)>,
) {
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(hf.join("config.json")).unwrap()).unwrap();
    let dim = |k: &str| cfg[k].as_u64().unwrap() as usize;
    let (dn, dr, dv) = (
        dim("qk_nope_head_dim"),
        dim("qk_rope_head_dim"),
        dim("v_head_dim"),
    );
    let pairs = [
        (
            "linear_q_up_proj",
            ["linear_qk_nope", "linear_qk_rope"],
            [dn, dr],
        ),
        (
            "linear_kv_up_proj",
            ["linear_kv_nope", "linear_v"],
            [dn, dv],
        ),
    ];
    let mut checked = 0;
    for (key, (shape, bytes)) in whole {
        for (up, parts, widths) in pairs {
            let Some(prefix) = key.strip_suffix(&format!("{up}.weight")) else {
                continue;
            };
            assert!(!split.contains_key(key), "{key} left whole");
            let row = bytes.len() / shape[0];
            let heads = shape[0] / (widths[0] + widths[1]);
            let mut joined = Vec::new();
            for h in 0..heads {
                for (part, w) in parts.iter().zip(widths) {
                    let (_, data) = &split[&format!("{prefix}{part}.weight")];
                    joined.extend_from_slice(&data[h * w * row..(h + 1) * w * row]);
                }
            }
            assert_eq!(&joined, bytes, "{key}");
            checked += 1;
        }
    }
    assert!(checked > 0, "no up projection in the rank file");
}

#[test]
fn multi_latent_attention_layouts_convert_into_each_other_byte_identical() {
    let tmp = tempfile::tempdir().unwrap();
    for (f, tp) in [("deepseek_v3", "2"), ("deepseek_v3_direct", "1")] {
        let at = |s: &str| tmp.path().join(format!("{f}-{s}"));
        let layout = ["--mla-layout", "mindspeed", "--tp", tp, "--pp", "2"];
        convert("megatron", &model(f), &at("fused"), &layout);
        let info = String::from_utf8(
            (mindkit(&[&"ckpt", &"info", &at("fused")]).success())
                .get_output()
                .stdout
                .clone(),
        )
        .unwrap();
        assert!(
            info.contains("in one linear_qkv (MindSpeed-LLM's deepseek_spec)"),
            "{info}"
        );
        // MindSpeed-LLM's layout → megatron-core's, and back, as the HF conversions write them
        convert(
            "megatron",
            &at("fused"),
            &at("apart"),
            &["--mla-layout", "mcore"],
        );
        convert(
            "megatron",
            &model(f),
            &at("direct"),
            &["--tp", tp, "--pp", "2"],
        );
        convert(
            "megatron",
            &at("apart"),
            &at("again"),
            &["--mla-layout", "mindspeed"],
        );
        // MindSpeed-LLM's --mla-mm-split: from HF, and from and into the other layouts
        let split = [
            "--mla-layout",
            "mindspeed-mm-split",
            "--tp",
            tp,
            "--pp",
            "2",
        ];
        convert("megatron", &model(f), &at("split"), &split);
        convert("megatron", &at("split"), &at("split-fused"), &layout[..2]);
        convert(
            "megatron",
            &at("split"),
            &at("split-apart"),
            &["--mla-layout", "mcore"],
        );
        convert("megatron", &at("apart"), &at("split-again"), &split[..2]);
        for r in ["mp_rank_00_000", "mp_rank_00_001"] {
            let read = |d: &str| rank_tensors(&rank_file(&at(d), r));
            assert_eq!(read("apart"), read("direct"), "{f}: {r}");
            assert_eq!(read("again"), read("fused"), "{f}: {r}");
            assert_eq!(read("split-fused"), read("fused"), "{f}: {r}");
            assert_eq!(read("split-apart"), read("direct"), "{f}: {r}");
            assert_eq!(read("split-again"), read("split"), "{f}: {r}");
            let fused = read("fused");
            assert!(fused.contains_key("decoder.layers.0.self_attention.linear_qkv.weight"));
            assert!(!fused.keys().any(|k| k.contains("down_proj")), "{f}: {r}");
            assert_split_by_head(&model(f), &fused, &read("split"));
        }
        let info = mindkit(&[&"ckpt", &"info", &at("split")]).success();
        let info = String::from_utf8(info.get_output().stdout.clone()).unwrap();
        assert!(info.contains("up projections split"), "{info}");
        convert("hf", &at("fused"), &at("hf"), &[]);
        assert_same_hf(&model(f), &at("hf"));
        convert("hf", &at("split"), &at("split-hf"), &[]);
        assert_same_hf(&model(f), &at("split-hf"));
    }
    let err = convert_err(
        "megatron",
        &model("deepseek_v3_direct"),
        &tmp.path().join("bad"),
        &["--mla-layout", "mindspeed", "--tp", "2"],
    );
    assert!(err.contains("without a query latent"), "{err}");
    let err = convert_err(
        "megatron",
        &model("qwen3"),
        &tmp.path().join("bad"),
        &["--mla-layout", "mindspeed"],
    );
    assert!(err.contains("has no multi-latent attention"), "{err}");
}

#[test]
fn dualpipev_stages_hold_their_v_of_chunks_and_convert_back_byte_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let at = |s: &str| tmp.path().join(s);
    let v = ["--pp", "2", "--schedules-method", "dualpipev"];
    for f in ["llama", "deepseek_v3_mtp"] {
        convert(
            "megatron",
            &model(f),
            &at(f),
            &[&v[..], &["--tp", "2"]].concat(),
        );
        let info = mindkit(&[&"ckpt", &"info", &at(f)]).success();
        let info = String::from_utf8(info.get_output().stdout.clone()).unwrap();
        assert!(info.contains("DualPipeV"), "{info}");
        // layers 0 | 3 on stage 0 (with the output layer), 1 | 2 on stage 1; the source's
        // layout kept when no new pipeline is asked for, and a plain one when it is
        let first = rank_tensors(&rank_file(&at(f), "mp_rank_00_000"));
        assert!(first.contains_key("embedding.word_embeddings.weight"));
        assert!(first.contains_key("model1.output_layer.weight"));
        assert!(first.contains_key("model1.decoder.layers.0.input_layernorm.weight"));
        let last = rank_tensors(&rank_file(&at(f), "mp_rank_00_001"));
        assert!(!last
            .keys()
            .any(|k| k.contains("output_layer") || k.contains("embedding")));
        convert("megatron", &at(f), &at(&format!("{f}-kept")), &[]);
        convert(
            "megatron",
            &at(f),
            &at(&format!("{f}-plain")),
            &["--pp", "2"],
        );
        convert(
            "megatron",
            &at(&format!("{f}-plain")),
            &at(&format!("{f}-v")),
            &v,
        );
        for r in ["mp_rank_00_000", "mp_rank_00_001"] {
            let read = |d: &str| rank_tensors(&rank_file(&at(d), r));
            assert_eq!(read(&format!("{f}-kept")), read(f), "{f}: {r}");
            assert!(!read(&format!("{f}-plain"))
                .keys()
                .any(|k| k.starts_with("model1")));
        }
        convert("hf", &at(&format!("{f}-v")), &at(&format!("{f}-hf")), &[]);
        assert_same_hf(&model(f), &at(&format!("{f}-hf")));
    }
    let cases: [(&str, &[&str], &str); 4] = [
        ("llama", &["--pp", "1"], "2 or more stages"),
        ("qwen3", &["--pp", "2"], "untied"),
        ("llama", &["--pp", "4"], "2 × 4 equal chunks"),
        (
            "llama",
            &["--pp", "2", "--ckpt-format", "torch_dist"],
            "dualpipev",
        ),
    ];
    for (f, extra, named) in cases {
        let args = [&["--schedules-method", "dualpipev"][..], extra].concat();
        let err = convert_err("megatron", &model(f), &at("bad"), &args);
        assert!(err.contains(named), "{f} {extra:?}: {err}");
        assert!(!at("bad").exists());
    }
}

#[test]
fn experts_split_over_expert_parallel_ranks_and_back_byte_identical() {
    let tmp = tempfile::tempdir().unwrap();
    for f in [
        "qwen3_moe",
        "qwen2_moe",
        "mixtral",
        "glm4_moe",
        "deepseek_v3",
        "deepseek_v2",
    ] {
        let (a, b, h) = (
            tmp.path().join(format!("{f}-a")),
            tmp.path().join(format!("{f}-b")),
            tmp.path().join(f),
        );
        // TP 2 × PP 2 × EP 2: mp_rank_TT_PPP_EEE; then PP 1 × EP 4: mp_rank_TT_EEE.
        convert(
            "megatron",
            &model(f),
            &a,
            &["--tp", "2", "--pp", "2", "--ep", "2"],
        );
        for r in ["mp_rank_00_000_000", "mp_rank_01_001_001"] {
            assert!(rank_file(&a, r).is_file(), "{f}: {r}");
        }
        let info = String::from_utf8(
            mindkit(&[&"ckpt", &"info", &a])
                .success()
                .get_output()
                .stdout
                .clone(),
        )
        .unwrap();
        assert!(info.contains("TP 2 × PP 2 × EP 2"), "{info}");
        assert!(info.contains("experts:     4 routed"), "{info}");
        run_convert(
            "megatron",
            &a,
            &b,
            &[
                "--tp",
                "1",
                "--pp",
                "1",
                "--target-expert-parallel-size",
                "4",
            ],
        )
        .success();
        assert!(rank_file(&b, "mp_rank_00_003").is_file(), "{f}");
        convert("hf", &b, &h, &[]);
        assert_same_hf(&model(f), &h);
    }
    let err = convert_err(
        "megatron",
        &model("qwen3_moe"),
        &tmp.path().join("x"),
        &["--ep", "3"],
    );
    assert!(
        err.contains("--ep 3 does not divide the 4 routed experts"),
        "{err}"
    );
    let err = convert_err(
        "megatron",
        &model("llama"),
        &tmp.path().join("y"),
        &["--ep", "2"],
    );
    assert!(err.contains("a dense model has no experts"), "{err}");
}

/// The rank directories of a converted checkpoint's iteration 1, sorted.
fn ranks(d: &Path) -> Vec<String> {
    let mut r: Vec<String> = std::fs::read_dir(d.join("iter_0000001"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    r.sort();
    r
}

#[test]
fn whole_experts_under_tensor_parallelism_are_written_in_the_files_megatron_and_mindspeed_save_and_read_back(
) {
    let tmp = tempfile::tempdir().unwrap();
    let info = |d: &Path, keys: bool| -> String {
        let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![&"ckpt", &"info"];
        if keys {
            args.push(&"--keys");
        }
        args.push(&d);
        String::from_utf8(mindkit(&args).success().get_output().stdout.clone()).unwrap()
    };
    for f in ["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"] {
        let [a, b, c, h] = ["a", "b", "c", "h"].map(|s| tmp.path().join(format!("{f}-{s}")));
        // TP 2 × EP 2 (EP a multiple of TP): the pairs (r mod TP, r), experts whole
        convert(
            "megatron",
            &model(f),
            &a,
            &[
                "--tp",
                "2",
                "--ep",
                "2",
                "--expert-tensor-parallel-size",
                "1",
            ],
        );
        assert_eq!(ranks(&a), ["mp_rank_00_000", "mp_rank_01_001"], "{f}");
        let shown = info(&a, true);
        assert!(
            shown.contains("TP 2 × PP 1 × EP 2 (ETP 1: whole experts)"),
            "{shown}"
        );
        let fc2 = |shown: &str| -> Vec<String> {
            (shown.lines())
                .filter(|l| l.contains("local_experts.0.linear_fc2.weight"))
                .map(|l| l.split("  ").last().unwrap().to_string())
                .collect()
        };
        let one = tmp.path().join(format!("{f}-one"));
        convert("megatron", &model(f), &one, &[]);
        let whole = fc2(&info(&one, true))[0].clone();
        assert_eq!(fc2(&shown), vec![whole; fc2(&shown).len()], "{f}: {shown}");
        assert!(fc2(&shown).len() >= 2, "{f}: {shown}");
        // TP 4 × PP 2 × EP 2 (TP a multiple of EP), kept whole by default: (t, t mod EP)
        convert(
            "megatron",
            &a,
            &b,
            &["--tp", "4", "--pp", "2", "--moe-grouped-gemm"],
        );
        let files = ["00_000_000", "00_001_000", "01_000_001", "01_001_001"];
        let mut want: Vec<String> = (files.iter().chain(&["02_000_000", "02_001_000"]))
            .chain(&["03_000_001", "03_001_001"])
            .map(|r| format!("mp_rank_{r}"))
            .collect();
        want.sort();
        assert_eq!(ranks(&b), want, "{f}");
        // back to experts split as the dense layers are, then to HF: the same weights
        convert(
            "megatron",
            &b,
            &c,
            &["--tp", "2", "--pp", "1", "--etp", "2"],
        );
        assert_eq!(ranks(&c).len(), 4, "{f}");
        assert!(info(&c, false).contains("TP 2 × PP 1 × EP 2,"), "{f}");
        convert("hf", &b, &h, &[]);
        assert_same_hf(&model(f), &h);
        std::fs::remove_dir_all(&h).unwrap();
        convert("hf", &c, &h, &[]);
        assert_same_hf(&model(f), &h);
    }
    // MindSpeed-LLM's --moe-tp-extend-ep: every TP × EP file, one whole expert each (block
    // e·TP + t), kept when resharding the pipeline
    let [x, y, h] = ["ext", "ext-pp", "ext-hf"].map(|s| tmp.path().join(s));
    convert(
        "megatron",
        &model("qwen3_moe"),
        &x,
        &["--tp", "2", "--ep", "2", "--moe-tp-extend-ep"],
    );
    assert_eq!(ranks(&x).len(), 4);
    let shown = info(&x, true);
    assert!(
        shown.contains("(moe_tp_extend_ep: whole experts over TP × EP)"),
        "{shown}"
    );
    assert!(!shown.contains("local_experts.1."), "{shown}");
    convert("megatron", &x, &y, &["--pp", "2"]);
    assert!(info(&y, false).contains("moe_tp_extend_ep"));
    convert("hf", &y, &h, &[]);
    assert_same_hf(&model("qwen3_moe"), &h);
    for (input, extra, message) in [
        (
            "llama",
            &["--tp", "2", "--etp", "1"][..],
            "a dense model has no experts",
        ),
        (
            "qwen3_moe",
            &["--tp", "4", "--etp", "3"],
            "expert tensor parallelism 3 does not divide TP 4",
        ),
        (
            "qwen3_moe",
            &["--tp", "2", "--etp", "4"],
            "expert tensor parallelism 4 does not divide TP 2",
        ),
        (
            "qwen3_moe",
            &["--tp", "2", "--ep", "4", "--moe-tp-extend-ep"],
            "which do not divide them",
        ),
        (
            "qwen3_moe",
            &["--tp", "2", "--etp", "1", "--moe-tp-extend-ep"],
            "MindSpeed-LLM refuses both",
        ),
    ] {
        let err = convert_err("megatron", &model(input), &tmp.path().join("x"), extra);
        assert!(err.contains(message), "{err}");
    }
}

#[test]
fn experts_split_over_fewer_ranks_than_tp_are_written_in_the_files_megatron_saves_and_read_back() {
    let tmp = tempfile::tempdir().unwrap();
    let info = |d: &Path| -> String {
        let out = mindkit(&[
            &"ckpt" as &dyn AsRef<std::ffi::OsStr>,
            &"info",
            &"--keys",
            &d,
        ]);
        String::from_utf8(out.success().get_output().stdout.clone()).unwrap()
    };
    for grouped in [false, true] {
        let [a, b, c, h] = ["a", "b", "c", "h"].map(|s| tmp.path().join(format!("{s}-{grouped}")));
        let mut flags = vec!["--tp", "4", "--ep", "2", "--etp", "2"];
        if grouped {
            flags.push("--moe-grouped-gemm");
        }
        // TP 4 × EP 2 × ETP 2: ranks r < ETP × EP = 4 of the expert view save, each into
        // mp_rank_{r mod TP}_{(r / ETP) mod EP}, its expert shard r mod ETP
        convert("megatron", &model("qwen3_moe"), &a, &flags);
        let files = ["00_000", "01_000", "02_001", "03_001"].map(|r| format!("mp_rank_{r}"));
        assert_eq!(ranks(&a), files);
        let shown = info(&a);
        assert!(
            shown.contains("TP 4 × PP 1 × EP 2 (ETP 2: experts split 2 ways)"),
            "{shown}"
        );
        // each expert's intermediate size 16 in halves, the dense MLP's 64 in quarters
        let expert_fc2 = match grouped {
            false => "local_experts.0.linear_fc2.weight  float32  [32, 8]",
            true => "experts.weight2  float32  [16, 32]",
        };
        assert!(shown.contains(expert_fc2), "{shown}");
        assert!(
            shown.contains("layers.0.mlp.linear_fc2.weight  float32  [32, 16]"),
            "{shown}"
        );
        convert("hf", &a, &h, &[]);
        assert_same_hf(&model("qwen3_moe"), &h);
        // resharded, the split is kept where it divides the new TP; then whole experts
        convert("megatron", &a, &b, &["--tp", "2", "--pp", "2"]);
        assert_eq!(ranks(&b).len(), 8);
        assert!(!info(&b).contains("ETP"), "ETP 2 = TP 2");
        convert("megatron", &a, &c, &["--etp", "1"]);
        let whole = ["00_000", "01_001", "02_000", "03_001"].map(|r| format!("mp_rank_{r}"));
        assert_eq!(ranks(&c), whole);
        for d in [&b, &c] {
            std::fs::remove_dir_all(&h).unwrap();
            convert("hf", d, &h, &[]);
            assert_same_hf(&model("qwen3_moe"), &h);
        }
    }
}

#[test]
fn grouped_experts_round_trip_and_are_refused_where_they_cannot_be() {
    let tmp = tempfile::tempdir().unwrap();
    for f in ["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"] {
        let (g, m, h) = (
            tmp.path().join(format!("{f}-g")),
            tmp.path().join(format!("{f}-m")),
            tmp.path().join(f),
        );
        convert(
            "megatron",
            &model(f),
            &g,
            &["--tp", "2", "--ep", "2", "--moe-grouped-gemm"],
        );
        // Grouped → per-expert (local_experts.N) at another layout → HF.
        convert("megatron", &g, &m, &["--tp", "1", "--ep", "4", "--pp", "2"]);
        convert("hf", &m, &h, &[]);
        assert_same_hf(&model(f), &h);
        // Transformer Engine's TEGroupedMLP: `linear_fc1.weight{i}`, read back as written.
        let te = [
            "--tp",
            "2",
            "--ep",
            "2",
            "--moe-grouped-gemm",
            "--layout",
            "mcore-te",
        ];
        let [t, u, k] = ["te", "te-again", "te-hf"].map(|s| tmp.path().join(format!("{f}-{s}")));
        convert("megatron", &g, &t, &te);
        let keys = String::from_utf8(
            mindkit(&[&"ckpt", &"info", &"--keys", &t])
                .success()
                .get_output()
                .stdout
                .clone(),
        )
        .unwrap();
        assert!(keys.contains("layout:      mcore-te, grouped experts (TEGroupedMLP"));
        for key in [
            "mlp.experts.linear_fc1.weight1 ",
            "mlp.experts.linear_fc2.weight1 ",
        ] {
            assert!(keys.contains(key), "{f}: no {key} in {keys}");
        }
        assert!(
            !keys.contains("local_experts") && !keys.contains("experts.weight"),
            "{keys}"
        );
        convert("megatron", &t, &u, &te);
        for rank in ["mp_rank_00_000", "mp_rank_01_001"] {
            let read = |d: &Path| std::fs::read(rank_file(d, rank)).unwrap();
            assert!(read(&t) == read(&u), "{f}: {rank} differs rewritten");
        }
        convert("hf", &t, &k, &[]);
        assert_same_hf(&model(f), &k);
    }
    let err = convert_err(
        "megatron",
        &model("llama"),
        &tmp.path().join("x"),
        &["--moe-grouped-gemm"],
    );
    assert!(err.contains("this model has no experts"), "{err}");
}

#[test]
fn reshard_to_tp4_pp2_vpp2_and_back_is_byte_identical() {
    let tmp = tempfile::tempdir().unwrap();
    for f in FAMILIES {
        let [a, b, c] = ["a", "b", "c"].map(|s| tmp.path().join(format!("{f}-{s}")));
        convert("megatron", &model(f), &a, &[]);
        convert(
            "megatron",
            &a,
            &b,
            &["--tp", "4", "--pp", "2", "--vpp", "2"],
        );
        assert!(rank_file(&b, "mp_rank_03_001").is_file());
        convert("megatron", &b, &c, &["--tp", "1", "--pp", "1"]);
        let read = |d: &Path| std::fs::read(rank_file(d, "mp_rank_00")).unwrap();
        assert!(
            read(&a) == read(&c),
            "{f}: tp1 → tp4/pp2/vpp2 → tp1 differs"
        );
    }
}

#[test]
fn layouts_uneven_stages_and_virtual_stage_size_round_trip() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: &[&[&str]] = &[
        &["--layout", "mcore-te", "--tp", "2"],
        &["--layout", "legacy", "--tp", "2", "--pp", "2"],
        &["--layout", "legacy", "--pp", "4"],
        &[
            "--pp",
            "3",
            "--first-stage-layers",
            "1",
            "--last-stage-layers",
            "1",
        ],
        &["--pp", "3", "--first-stage-layers", "2"],
        &["--pp", "2", "--decoder-last-pipeline-num-layers", "3"],
        &["--pp", "2", "--num-layers-per-virtual-stage", "1"],
    ];
    for (i, extra) in cases.iter().enumerate() {
        for f in ["qwen2", "llama"] {
            let (m, h) = (
                tmp.path().join(format!("{f}{i}-m")),
                tmp.path().join(format!("{f}{i}-h")),
            );
            convert("megatron", &model(f), &m, extra);
            convert("hf", &m, &h, &[]);
            assert_same_hf(&model(f), &h);
        }
    }
}

#[test]
fn megatron_to_megatron_keeps_uneven_stages_unless_told_otherwise() {
    let tmp = tempfile::tempdir().unwrap();
    let [a, b, c] = ["a", "b", "c"].map(|s| tmp.path().join(s));
    convert(
        "megatron",
        &model("llama"),
        &a,
        &["--pp", "2", "--first-stage-layers", "1"],
    );
    let read = |d: &Path, r: &str| std::fs::read(rank_file(d, r)).unwrap();
    convert("megatron", &a, &b, &[]);
    for r in ["mp_rank_00_000", "mp_rank_00_001"] {
        assert!(read(&a, r) == read(&b, r), "{r} differs");
    }
    convert("megatron", &a, &c, &["--pp", "2"]);
    assert!(read(&a, "mp_rank_00_000") != read(&c, "mp_rank_00_000"));
}

#[test]
fn a_release_checkpoint_is_read_through_its_tracker() {
    let tmp = tempfile::tempdir().unwrap();
    let (m, h) = (tmp.path().join("m"), tmp.path().join("h"));
    convert("megatron", &model("qwen2"), &m, &["--tp", "2"]);
    std::fs::rename(m.join("iter_0000001"), m.join("release")).unwrap();
    std::fs::write(m.join("latest_checkpointed_iteration.txt"), "release").unwrap();
    convert("hf", &m, &h, &[]);
    assert_same_hf(&model("qwen2"), &h);
}

#[test]
fn dtype_cast_matches_a_direct_cast() {
    let tmp = tempfile::tempdir().unwrap();
    let (m, h) = (tmp.path().join("m"), tmp.path().join("h"));
    convert(
        "megatron",
        &model("llama"),
        &m,
        &["--tp", "2", "--dtype", "bf16"],
    );
    convert("hf", &m, &h, &[]);
    let (orig, got) = (
        HfWeights::open(&model("llama")).unwrap(),
        HfWeights::open(&h).unwrap(),
    );
    for name in orig.entries().keys() {
        let want = orig.read(name).unwrap().cast(DType::BF16).unwrap();
        assert_eq!(got.read(name).unwrap(), want, "{name}");
    }
    let cfg = std::fs::read_to_string(h.join("config.json")).unwrap();
    assert!(cfg.contains("\"torch_dtype\": \"bfloat16\""), "{cfg}");
}

#[test]
fn sharded_hf_output_has_an_index() {
    let tmp = tempfile::tempdir().unwrap();
    let (m, h, h2) = (
        tmp.path().join("m"),
        tmp.path().join("h"),
        tmp.path().join("h2"),
    );
    convert("megatron", &model("internlm"), &m, &[]);
    convert("hf", &m, &h, &["--max-shard-size", "50KB"]);
    let index = std::fs::read_to_string(h.join("model.safetensors.index.json")).unwrap();
    assert!(index.contains("model-00001-of-0000"), "{index}");
    assert_same_hf(&model("internlm"), &h);
    // And a sharded HF input converts like the single file.
    convert("hf", &h, &h2, &[]);
    assert_same_hf(&model("internlm"), &h2);
}

#[test]
fn ckpt_info_describes_both_formats() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("m");
    convert(
        "megatron",
        &model("qwen2"),
        &m,
        &["--tp", "2", "--pp", "2", "--vpp", "2"],
    );
    let out = mindkit(&[&"ckpt", &"info", &m, &"--keys"]).success();
    let text = String::from_utf8(out.get_output().stdout.clone()).unwrap();
    for want in [
        "layout:      mcore",
        "TP 2 × PP 2 × VPP 2",
        "family:      qwen2",
        "heads 8 (kv 4)",
        "padded vocab 256",
        "model1.decoder.layers.0.self_attention.linear_qkv.bias",
    ] {
        assert!(text.contains(want), "{want} not in\n{text}");
    }
    let out = mindkit(&[&"ckpt", &"info", &model("baichuan")]).success();
    let text = String::from_utf8(out.get_output().stdout.clone()).unwrap();
    assert!(text.contains("family:      baichuan"), "{text}");
}

#[test]
fn qwen3_head_norms_travel_replicated_and_are_described() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("m");
    convert("megatron", &model("qwen3"), &m, &["--tp", "2", "--pp", "2"]);
    let out = mindkit(&[&"ckpt", &"info", &m, &"--keys"]).success();
    let text = String::from_utf8(out.get_output().stdout.clone()).unwrap();
    for want in [
        "family:      qwen3",
        "heads 8 (kv 4), head_dim 16",
        "q/k layernorm true",
        "decoder.layers.1.self_attention.q_layernorm.weight",
        "decoder.layers.1.self_attention.k_layernorm.weight",
    ] {
        assert!(text.contains(want), "{want} not in\n{text}");
    }
    // The legacy layout builds no q/k layernorms: refused before anything is written.
    let legacy = tmp.path().join("legacy");
    let err = convert_err(
        "megatron",
        &model("qwen3"),
        &legacy,
        &["--layout", "legacy"],
    );
    assert!(
        err.contains("the legacy layout has no q/k layernorms"),
        "{err}"
    );
    assert!(!legacy.exists());
    // A checkpoint with q/k layernorms read as a family without them is an error.
    let h = tmp.path().join("h");
    let err = convert_err("hf", &m, &h, &["--family", "llama"]);
    assert!(
        err.contains("args.qk_layernorm is True but the llama family has no q/k layernorms"),
        "{err}"
    );
    assert!(leftovers(tmp.path()).is_empty());
}

#[test]
fn invalid_plans_are_refused_before_writing() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let err = convert_err("megatron", &model("llama"), &out, &["--tp", "3"]);
    assert!(
        err.contains("--tp 3 does not divide num_attention_heads = 8"),
        "{err}"
    );
    assert!(err.contains("TP sizes that work: 1, 2, 4"), "{err}");
    let err = convert_err("megatron", &model("llama"), &out, &["--pp", "3"]);
    assert!(
        err.contains("num_layers 4 is not divisible by --pp 3"),
        "{err}"
    );
    let err = convert_err(
        "megatron",
        &model("llama"),
        &out,
        &["--pp", "2", "--vpp", "2", "--first-stage-layers", "1"],
    );
    assert!(
        err.contains("pipeline stage 0 would hold 1 layers, which --vpp 2 does not divide"),
        "{err}"
    );
    let err = convert_err(
        "megatron",
        &model("llama"),
        &out,
        &[
            "--pp",
            "4",
            "--first-stage-layers",
            "2",
            "--last-stage-layers",
            "1",
        ],
    );
    assert!(
        err.contains("4 layers cannot be split as first 2 + last 1 with the rest evenly over 2"),
        "{err}"
    );
    let err = convert_err("megatron", &model("llama"), &out, &["--family", "gpt-neox"]);
    assert!(
        err.contains("supported: llama, mistral, qwen2, internlm, baichuan, aquila"),
        "{err}"
    );
    assert!(!out.exists());
    assert!(leftovers(tmp.path()).is_empty());
}

#[test]
fn force_keeps_user_files() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("mine.txt"), "user data").unwrap();
    let err = convert_err("megatron", &model("llama"), &out, &[]);
    assert!(err.contains("already exists (pass --force"), "{err}");
    // --force replaces only a previous checkpoint: the user's file is named, and kept.
    let err = convert_err("megatron", &model("llama"), &out, &["--force"]);
    assert!(err.contains("holds mine.txt"), "{err}");
    assert!(err.contains("Megatron checkpoint"), "{err}");
    assert_eq!(
        std::fs::read_to_string(out.join("mine.txt")).unwrap(),
        "user data"
    );
    assert!(leftovers(tmp.path()).is_empty());
}

#[test]
fn force_replaces_a_previous_output() {
    let tmp = tempfile::tempdir().unwrap();
    let (m, h) = (tmp.path().join("m"), tmp.path().join("h"));
    convert("megatron", &model("llama"), &m, &[]);
    convert("megatron", &model("qwen2"), &m, &["--force", "--tp", "2"]);
    assert!(rank_file(&m, "mp_rank_01").is_file());
    convert("hf", &m, &h, &[]);
    assert_same_hf(&model("qwen2"), &h);
    convert("hf", &model("llama"), &h, &["--force"]);
    assert_same_hf(&model("llama"), &h);
    // A Megatron checkpoint is not a previous HF output.
    let err = convert_err("hf", &model("llama"), &m, &["--force"]);
    assert!(err.contains("iter_0000001/"), "{err}");
    assert!(err.contains("latest_checkpointed_iteration.txt"), "{err}");
    assert!(rank_file(&m, "mp_rank_01").is_file());
    let mut left = leftovers(tmp.path());
    left.sort();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn output_around_or_inside_the_input_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let proj = tmp.path().join("proj");
    let input = proj.join("model");
    copy_dir(&model("llama"), &input);
    std::fs::write(proj.join("train.log"), "step 1").unwrap();
    let err = convert_err("megatron", &input, &proj, &["--force"]);
    assert!(err.contains("contains the input"), "{err}");
    assert!(err.contains(&*proj.to_string_lossy()), "{err}");
    assert!(err.contains(&*input.to_string_lossy()), "{err}");
    let err = convert_err("hf", &input, &input.join("."), &["--force"]);
    assert!(err.contains("is the input"), "{err}");
    let err = convert_err("megatron", &input, &input.join("out"), &["--force"]);
    assert!(err.contains("lies inside the input"), "{err}");
    assert_eq!(
        std::fs::read_to_string(proj.join("train.log")).unwrap(),
        "step 1"
    );
    assert_same_hf(&model("llama"), &input);
    assert!(!input.join("out").exists());
}

/// Every file under `dir` is 0644 and every directory (`dir` too) 0755.
fn assert_plain_modes(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let mode = dir.metadata().unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o755, "{}: {mode:o}", dir.display());
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            assert_plain_modes(&p);
        } else {
            let mode = p.metadata().unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o644, "{}: {mode:o}", p.display());
        }
    }
}

#[test]
fn outputs_get_the_umask_permissions() {
    let tmp = tempfile::tempdir().unwrap();
    let (m, h) = (tmp.path().join("m"), tmp.path().join("h"));
    // A private (0600) tokenizer file in the input must not make a private output either.
    let input = tmp.path().join("in");
    copy_dir(&model("llama"), &input);
    use std::os::unix::fs::PermissionsExt;
    let tok = input.join("tokenizer.json");
    std::fs::set_permissions(&tok, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (to, from) = (&"--to", &"--input");
    let args = |fmt, input, output| -> Vec<&dyn AsRef<std::ffi::OsStr>> {
        vec![
            &"convert",
            &"--quiet",
            to,
            fmt,
            from,
            input,
            &"--output",
            output,
            &"--tp",
            &"2",
        ]
    };
    run_with_umask_022(&args(&"megatron", &input, &m));
    assert_plain_modes(&m);
    run_with_umask_022(&args(&"hf", &m, &h));
    assert_plain_modes(&h);
}

#[test]
fn stale_temporaries_are_named_and_removed_with_force() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    // What a killed run leaves: a partial temporary directory beside the output.
    let stale = tmp.path().join(".mindkit-megatron-out-Xy12zW");
    std::fs::create_dir_all(stale.join("iter_0000001")).unwrap();
    let err = convert_err("megatron", &model("llama"), &out, &[]);
    assert!(err.contains("interrupted"), "{err}");
    assert!(err.contains(&*stale.to_string_lossy()), "{err}");
    assert!(err.contains("--force"), "{err}");
    assert!(stale.exists() && !out.exists());
    convert("megatron", &model("llama"), &out, &["--force"]);
    assert!(!stale.exists());
    assert!(rank_file(&out, "mp_rank_00").is_file());
    assert!(leftovers(tmp.path()).is_empty());
}

#[test]
fn a_write_error_prints_only_that_error() {
    // Files larger than the limit fail to write with EFBIG ("File too large"), as a full disk
    // fails with ENOSPC; SIGXFSZ, which would kill the process instead, is ignored.
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    for (format, file) in [
        ("torch", "model_optim_rng.pt"),
        ("torch_dist", "__0_0.distcp"),
    ] {
        let output = std::process::Command::new("sh")
            .args(["-c", "trap '' XFSZ; ulimit -f 64; exec \"$0\" \"$@\""])
            .arg(assert_cmd::cargo::cargo_bin("mindkit"))
            .args(["convert", "--quiet", "--to", "megatron", "--input"])
            .arg(model("llama"))
            .args(["--ckpt-format", format, "--output"])
            .arg(&out)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{err}");
        assert!(err.contains(&format!("{file}: File too large")), "{err}");
        assert_eq!(err.lines().count(), 1, "only the error: {err}");
        assert!(!out.exists());
        assert!(leftovers(tmp.path()).is_empty());
    }
}

#[test]
fn damaged_inputs_give_errors_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    // Truncated safetensors.
    let hf = tmp.path().join("hf");
    copy_dir(&model("llama"), &hf);
    let st = hf.join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() / 2]).unwrap();
    let err = convert_err("megatron", &hf, &out, &[]);
    assert!(
        err.contains("model.safetensors: bad safetensors file"),
        "{err}"
    );
    // config.json that disagrees with the tensors.
    std::fs::write(&st, &bytes).unwrap();
    let cfg = std::fs::read_to_string(hf.join("config.json")).unwrap();
    std::fs::write(
        hf.join("config.json"),
        cfg.replace("\"intermediate_size\": 64", "\"intermediate_size\": 96"),
    )
    .unwrap();
    let err = convert_err("megatron", &hf, &out, &[]);
    assert!(
        err.contains("tensor model.layers.0.mlp.gate_proj.weight has shape [64, 32], config.json implies [96, 32]"),
        "{err}"
    );
    // Megatron: missing rank file, truncated rank file, forbidden pickle global.
    let m = tmp.path().join("m");
    convert("megatron", &model("llama"), &m, &["--tp", "2"]);
    let victim = rank_file(&m, "mp_rank_01");
    let good = std::fs::read(&victim).unwrap();
    std::fs::remove_file(&victim).unwrap();
    let err = convert_err("hf", &m, &out, &[]);
    assert!(
        err.contains("missing rank file") && err.contains("mp_rank_01"),
        "{err}"
    );
    std::fs::write(&victim, &good[..good.len() - 100]).unwrap();
    let err = convert_err("hf", &m, &out, &[]);
    assert!(err.contains("mp_rank_01/model_optim_rng.pt"), "{err}");
    let evil = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/torch/evil.pt");
    std::fs::copy(evil, &victim).unwrap();
    let err = convert_err("hf", &m, &out, &[]);
    assert!(err.contains("forbidden global"), "{err}");
    // A missing shard named by the index.
    let sharded = tmp.path().join("sharded");
    std::fs::write(&victim, &good).unwrap();
    convert("hf", &m, &sharded, &["--max-shard-size", "50KB"]);
    let mut shards: Vec<PathBuf> = std::fs::read_dir(&sharded)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.to_string_lossy().ends_with(".safetensors"))
        .collect();
    shards.sort();
    assert!(shards.len() > 2, "{shards:?}");
    std::fs::remove_file(&shards[1]).unwrap();
    let err = convert_err("megatron", &sharded, &out, &[]);
    let name = shards[1]
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert!(
        err.contains("missing weight shard") && err.contains(&name),
        "{err}"
    );
    assert!(!out.exists());
    assert!(leftovers(tmp.path()).is_empty());
}

#[test]
fn multi_token_prediction_layouts_convert_into_each_other_byte_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let at = |s: &str| tmp.path().join(s);
    let f = model("deepseek_v3_mtp");
    let split = ["--tp", "2", "--pp", "2", "--ep", "2"];
    convert("megatron", &f, &at("mindspeed"), &split);
    let mcore = [&split[..], &["--mtp-layout", "mcore", "--moe-grouped-gemm"]].concat();
    convert("megatron", &f, &at("mcore"), &mcore);
    convert(
        "megatron",
        &at("mcore"),
        &at("back"),
        &["--mtp-layout", "mindspeed"],
    );
    let read = |d: &str, r: &str| rank_tensors(&rank_file(&at(d), r));
    // the last stage: the depth with the embedding's copy, its norm where each layout keeps it
    let (ms, mc) = (
        read("mindspeed", "mp_rank_01_001_001"),
        read("mcore", "mp_rank_01_001_001"),
    );
    for k in [
        "embedding.word_embeddings.weight",
        "final_layernorm.weight",
        "mtp.layers.0.eh_proj.weight",
        "mtp.layers.0.transformer_layer.mlp.experts.local_experts.0.linear_fc1.weight",
        "mtp.final_layernorms.0.weight",
    ] {
        assert!(ms.contains_key(k), "{k}: {:?}", ms.keys());
    }
    for k in [
        "decoder.final_layernorm.weight",
        "mtp.layers.0.final_layernorm.weight",
        "mtp.layers.0.transformer_layer.mlp.experts.weight1",
    ] {
        assert!(mc.contains_key(k), "{k}: {:?}", mc.keys());
    }
    assert_eq!(ms["mtp.layers.0.eh_proj.weight"].0, [16, 64]);
    for r in ["mp_rank_00_000_000", "mp_rank_01_001_001"] {
        assert_eq!(read("back", r), read("mindspeed", r), "{r}");
    }
    // the embedding and output copies DeepSeek's HF layout keeps in the depth, back as they were
    convert("hf", &at("mcore"), &at("hf"), &[]);
    assert_same_hf(&f, &at("hf"));
    let err = convert_err(
        "megatron",
        &model("qwen3"),
        &at("bad"),
        &["--mtp-layout", "mcore"],
    );
    assert!(
        err.contains("has no multi-token prediction depths"),
        "{err}"
    );
    let err = convert_err("megatron", &f, &at("bad"), &["--layout", "mcore-te"]);
    assert!(
        err.contains("is written in the megatron-core local layout"),
        "{err}"
    );
}

#[test]
fn deepseek_v2s_group_limited_greedy_routing_converts_both_ways_and_bad_groups_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("v2");
    std::fs::create_dir(&dir).unwrap();
    let from = model("deepseek_v2");
    std::fs::copy(
        from.join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let text = std::fs::read_to_string(from.join("config.json")).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
    // 4 experts, top-2: (groups, kept, whether converted (config carried back), or the field
    // refused)
    for (method, groups, kept, outcome) in [
        ("group_limited_greedy", 2, 1, Ok(())),
        // groups that limit nothing (routed as greedy routes)
        ("group_limited_greedy", 2, 2, Ok(())),
        ("group_limited_greedy", 1, 1, Ok(())),
        ("group_limited_greedy", 3, 1, Err("\"topk_group\"")),
        ("group_limited_greedy", 4, 1, Err("\"topk_group\"")),
        ("noaux_tc", 2, 1, Err("\"topk_method\"")),
    ] {
        cfg["topk_method"] = method.into();
        (cfg["n_group"], cfg["topk_group"]) = (groups.into(), kept.into());
        std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
        let out = tmp.path().join(format!("m{method}{groups}{kept}"));
        match outcome {
            Err(field) => {
                let err = convert_err("megatron", &dir, &out, &[]);
                assert!(err.contains(field), "{method} {groups} {kept}: {err}");
            }
            Ok(()) => {
                convert("megatron", &dir, &out, &["--ep", "2"]);
                let back = tmp.path().join(format!("h{method}{groups}{kept}"));
                convert("hf", &out, &back, &[]);
                let text = std::fs::read_to_string(back.join("config.json")).unwrap();
                let got: serde_json::Value = serde_json::from_str(&text).unwrap();
                for key in ["topk_method", "n_group", "topk_group"] {
                    assert_eq!(got[key], cfg[key], "{groups} {kept}: {key}");
                }
            }
        }
    }
}
