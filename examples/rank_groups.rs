//! Prints, as JSON, the rank groups `mindkit train` forms for a layout, keyed by megatron-core's
//! `RankGenerator` tokens, for tests/interop/test_parallel.py to compare with megatron-core's:
//!   rank_groups WORLD TP PP CP
use mindkit::train::parallel::{Axis, Layout};

fn main() -> anyhow::Result<()> {
    let n: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    let [world, tp, pp, cp] = n[..] else {
        anyhow::bail!("usage: rank_groups WORLD TP PP CP");
    };
    let layout = Layout::new(world, tp, pp, cp)?;
    let kinds: [&[Axis]; 8] = [
        &[Axis::Tp],
        &[Axis::Cp],
        &[Axis::Dp],
        &[Axis::Pp],
        &[Axis::Tp, Axis::Pp],
        &[Axis::Dp, Axis::Cp],
        &[Axis::Tp, Axis::Cp],
        &[Axis::Tp, Axis::Dp, Axis::Cp],
    ];
    let members: Vec<String> = kinds
        .iter()
        .map(|axes| {
            let token: Vec<&str> = axes.iter().map(|a| a.token()).collect();
            let groups = serde_json::to_string(&layout.groups(axes)).unwrap();
            format!("{:?}: {groups}", token.join("-"))
        })
        .collect();
    println!("{{{}}}", members.join(", "));
    Ok(())
}
