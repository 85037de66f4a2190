//! LongRoPE (Phi-3.5's RoPE scaling) as MindSpeed-LLM's args spell it (`--rope-scaling-type
//! longrope`, `--long-factor`, `--short-factor` — lists of one factor per frequency —,
//! `--long-mscale`, `--short-mscale`, `--longrope-freqs-type outer|mul`,
//! `--rope-scaling-original-max-position-embeddings`; its features_manager/common/rotary.py)
//! and as a `rope_scaling` object (`rope_type: longrope`, transformers' keys, and
//! `freqs_type` for MindSpeed-LLM's two ways of computing the angles).

use super::{arg, arg_positive, arg_str, ConfigError, FieldResult, Value};
use serde_json::{json, Value as Json};

/// A list of positive numbers in `args.{name}`.
fn factors(args: &[(String, Value)], name: &str) -> FieldResult<Vec<f64>> {
    let bad = |got: String| ConfigError::OutOfRange {
        field: format!("args.{name}"),
        got,
        expected: "a list of positive numbers (LongRoPE's factor of each frequency)",
    };
    let Some(Value::List(items) | Value::Tuple(items)) = arg(args, name) else {
        return Err(bad(format!("{:?}", arg(args, name))));
    };
    (items.iter())
        .map(|v| match v {
            Value::Float(f) if f.is_finite() && *f > 0.0 => Ok(*f),
            Value::Int(i) if *i > 0 => Ok(*i as f64),
            other => Err(bad(format!("{other:?}"))),
        })
        .collect()
}

/// The `rope_scaling` of Megatron args with `rope_scaling_type` longrope.
pub(super) fn longrope_from_args(args: &[(String, Value)]) -> FieldResult<Json> {
    let original = arg_positive(args, "rope_scaling_original_max_position_embeddings")?.ok_or(
        ConfigError::OutOfRange {
            field: "args.rope_scaling_original_max_position_embeddings".into(),
            got: "None".into(),
            expected: "a number: LongRoPE needs the original context length",
        },
    )?;
    let mscales = (
        arg_positive(args, "long_mscale")?,
        arg_positive(args, "short_mscale")?,
    );
    if mscales.0.is_some() != mscales.1.is_some() {
        return Err(ConfigError::OutOfRange {
            field: "args.long_mscale".into(),
            got: format!("{mscales:?}"),
            expected: "long_mscale and short_mscale both set or neither (MindSpeed-LLM)",
        });
    }
    let freqs = arg_str(args, "longrope_freqs_type")?.unwrap_or("mul");
    if !["mul", "outer"].contains(&freqs) {
        return Err(ConfigError::OutOfRange {
            field: "args.longrope_freqs_type".into(),
            got: format!("{freqs:?}"),
            expected: "mul or outer",
        });
    }
    Ok(json!({
        "rope_type": "longrope",
        "long_factor": factors(args, "long_factor")?,
        "short_factor": factors(args, "short_factor")?,
        "original_max_position_embeddings": original,
        "long_mscale": mscales.0,
        "short_mscale": mscales.1,
        "freqs_type": freqs,
    }))
}

/// The args of a LongRoPE `rope_scaling` (none for another).
pub(super) fn longrope_args(r: Option<&Json>) -> Vec<(&'static str, Value)> {
    let Some(r) = r.filter(|r| r.get("rope_type").and_then(Json::as_str) == Some("longrope"))
    else {
        return vec![];
    };
    let list = |key: &str| {
        let values = r.get(key).and_then(Json::as_array).into_iter().flatten();
        Value::List(values.filter_map(Json::as_f64).map(Value::Float).collect())
    };
    let number = |key: &str| {
        r.get(key)
            .and_then(Json::as_f64)
            .map_or(Value::None, Value::Float)
    };
    // an int in MindSpeed-LLM's args
    let original = (r
        .get("original_max_position_embeddings")
        .and_then(Json::as_f64))
    .map(|o| match o.fract() == 0.0 {
        true => Value::Int(o as i64),
        false => Value::Float(o),
    });
    vec![
        ("rope_scaling_type", Value::Str("longrope".into())),
        ("long_factor", list("long_factor")),
        ("short_factor", list("short_factor")),
        ("long_mscale", number("long_mscale")),
        ("short_mscale", number("short_mscale")),
        (
            "longrope_freqs_type",
            Value::Str(
                r.get("freqs_type")
                    .and_then(Json::as_str)
                    .unwrap_or("mul")
                    .into(),
            ),
        ),
        (
            "rope_scaling_original_max_position_embeddings",
            original.unwrap_or(Value::None),
        ),
    ]
}
