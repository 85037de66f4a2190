//! The NPU backend's HCCL communicator on the CANN stand-in (whose libhccl side runs the
//! collectives across the ranks of this machine): ranks as threads, one stand-in device each,
//! give the same results, bit for bit, as the CPU backend's thread group, host values' collectives
//! included.

mod common;

use mindkit::engine::comm::{Communicator, ReduceOp, MAX_HOST_BYTES};
use mindkit::engine::cpu::comm::thread_group;
use mindkit::engine::cpu::Cpu;
use mindkit::engine::{Backend, Device};
use mindkit::npu::comm::{root_info, Hccl};
use mindkit::npu::Npu;
use mindkit::tensor::DType;
use std::time::Duration;

/// Every collective once on rank `c` of a group, on backend `b`: each result, as f32.
fn exercise<B: Backend, C: Communicator<Tensor = B::Tensor>>(b: &B, c: &C) -> Vec<Vec<f32>> {
    let (r, n) = (c.rank() as f32, c.size());
    let values = |v: &[f32]| b.upload_f32(&[v.len()], v).unwrap();
    let mut sum = values(&[r + 0.25, -3.0 * r]);
    c.all_reduce(&mut sum, ReduceOp::Sum).unwrap();
    let mut max = b.cast(&values(&[r / 3.0, 1.0 - r]), DType::BF16).unwrap();
    c.all_reduce(&mut max, ReduceOp::Max).unwrap();
    let mut gathered = b.zeros(&[2 * n], DType::F32).unwrap();
    c.all_gather(&values(&[r, r + 0.5]), &mut gathered).unwrap();
    let spread: Vec<f32> = (0..2 * n).map(|i| i as f32 * (r + 1.0)).collect();
    let mut block = b.zeros(&[2], DType::F32).unwrap();
    c.reduce_scatter(&values(&spread), &mut block, ReduceOp::Sum)
        .unwrap();
    let mut root = values(&[r + 7.0; 3]);
    c.broadcast(&mut root, n - 1).unwrap();
    // a ring: each rank sends to the next, receives from the previous
    let rank = c.rank();
    c.send(&values(&[r * 11.0]), (rank + 1) % n).unwrap();
    let mut got = b.zeros(&[1], DType::F32).unwrap();
    c.recv(&mut got, (rank + n - 1) % n).unwrap();
    [sum, max, gathered, block, root, got]
        .iter()
        .map(|t| b.download_f32(t).unwrap())
        .collect()
}

/// What the host-value collectives give rank `c` of a group: f32 and f64 sums that depend on
/// their order, maxima, gathered bytes and f32s, a broadcast non-ASCII path and an empty one.
type Host = (
    Vec<f32>,
    Vec<f64>,
    Vec<u8>,
    Vec<f32>,
    Vec<u8>,
    Vec<u8>,
    Vec<f32>,
);

fn host_values<C: Communicator>(c: &C) -> Host {
    let (rank, n) = (c.rank(), c.size());
    let r = rank as f32;
    let mut f32s = vec![[1e8, 1.0, -1e8][rank % 3], r / 3.0];
    c.all_reduce_f32(&mut f32s, ReduceOp::Sum).unwrap();
    let mut max = [r, -r];
    c.all_reduce_f32(&mut max, ReduceOp::Max).unwrap();
    f32s.extend(max);
    let two53 = 2f64.powi(53);
    let mut f64s = vec![[two53, 1.0, -two53][rank % 3], f64::from(r) / 3.0];
    c.all_reduce_f64(&mut f64s, ReduceOp::Sum).unwrap();
    let mut wide_max = [-f64::from(r)];
    c.all_reduce_f64(&mut wide_max, ReduceOp::Max).unwrap();
    f64s.extend(wide_max);
    let bytes = c.all_gather_bytes(&[rank as u8, 0xff]).unwrap();
    let gathered = c.all_gather_f32(&[r, r + 0.5]).unwrap();
    let mut path = match rank {
        0 => Vec::new(),
        _ => b"/save/\xc3\xa9t\xc3\xa9-\xff".to_vec(),
    };
    c.broadcast_bytes(&mut path, n - 1).unwrap();
    let mut nothing = vec![9; rank];
    c.broadcast_bytes(&mut nothing, 0).unwrap();
    let mut losses = [r; 5];
    c.broadcast_f32(&mut losses, 1).unwrap();
    (f32s, f64s, bytes, gathered, path, nothing, losses.to_vec())
}

#[test]
fn hccl_between_npu_ranks_gives_the_cpu_thread_groups_results() {
    const RANKS: usize = 3;
    let dir = tempfile::tempdir().unwrap();
    let home = common::toolkit(&dir.path().join("toolkit"), common::stand_in());
    // This file's only test: the environment is its own.
    std::env::set_var("ASCEND_TOOLKIT_HOME", &home);
    std::env::set_var("MINDKIT_STAND_IN_DEVICES", RANKS.to_string());
    std::env::set_var("HCCL_CONNECT_TIMEOUT", "20");
    let on_cpu: Vec<_> = std::thread::scope(|s| {
        let ranks: Vec<_> = thread_group(RANKS, Duration::from_secs(20))
            .into_iter()
            .map(|c| s.spawn(move || (exercise(&Cpu, &c), host_values(&c))))
            .collect();
        ranks.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let root = root_info().unwrap();
    let on_npu: Vec<_> = std::thread::scope(|s| {
        let ranks: Vec<_> = (0..RANKS)
            .map(|rank| {
                let root = &root;
                s.spawn(move || {
                    let npu = Npu::open(rank as i32).unwrap();
                    let c = Hccl::join(&npu, RANKS, rank, root).unwrap();
                    (exercise(&npu, &c), host_values(&c))
                })
            })
            .collect();
        ranks.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(on_npu, on_cpu);
    assert_eq!(on_cpu[1].0[0], [3.75, -9.0], "{on_cpu:?}");
    let (f32s, f64s, bytes, _, path, nothing, losses) = &on_cpu[2].1;
    assert_eq!(f32s, &[0.0, 1.0, 2.0, 0.0]);
    assert_eq!(f64s, &[0.0, 1.0, 0.0]);
    assert_eq!(bytes, &[0, 0xff, 1, 0xff, 2, 0xff]);
    assert_eq!(path, b"/save/\xc3\xa9t\xc3\xa9-\xff");
    assert!(nothing.is_empty() && losses == &[1.0; 5]);
    refusals();
}

/// What each of two NPU ranks' `f` returns, joined to one group.
fn on_two_npus<T: Send>(f: impl Fn(&Npu, Hccl) -> T + Sync) -> Vec<T> {
    let root = root_info().unwrap();
    std::thread::scope(|s| {
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let (root, f) = (&root, &f);
                s.spawn(move || {
                    let npu = Npu::open(rank as i32).unwrap();
                    let c = Hccl::join(&npu, 2, rank, root).unwrap();
                    f(&npu, c)
                })
            })
            .collect();
        ranks.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The stand-in's HCCL refuses ranks that disagree, and a rank that leaves or never comes
/// fails the others instead of hanging them.
fn refusals() {
    let disagree = on_two_npus(|npu, c| {
        let mut x = npu.zeros(&[2 + c.rank()], DType::F32).unwrap();
        c.all_reduce(&mut x, ReduceOp::Sum).unwrap_err().to_string()
    });
    for e in &disagree {
        assert!(
            e.contains("HCCL_E_PARA") && e.contains("ranks disagree") && e.contains("count: 3"),
            "{e}"
        );
    }
    // host values: lengths travel first, so a disagreement is named, not HCCL's to find
    let lengths = on_two_npus(|_, c| {
        let gathered = c.all_gather_bytes(&vec![1; 3 + c.rank()]).unwrap_err();
        let mut losses = vec![0.5; 2 + c.rank()];
        let broadcast = c.broadcast_f32(&mut losses, 0).err();
        let mut huge = vec![0; MAX_HOST_BYTES + 1];
        let over = c.broadcast_bytes(&mut huge, 1).unwrap_err();
        [Some(gathered), broadcast, Some(over)].map(|e| e.map(|e| e.to_string()))
    });
    for [gathered, _, over] in &lengths {
        let gathered = gathered.as_deref().unwrap_or_default();
        assert!(
            gathered
                .contains("all_gather_bytes: ranks disagree on the length: [3, 4] bytes by rank"),
            "{gathered}"
        );
        let over = over.as_deref().unwrap_or_default();
        assert!(
            over.contains("broadcast_bytes: 1048577 bytes from rank 1, more than the 1048576"),
            "{over}"
        );
    }
    assert_eq!(lengths[0][1], None, "the root cannot know");
    let other = lengths[1][1].as_deref().unwrap_or_default();
    assert!(
        other.contains("broadcast_f32: rank 0 sends 8 bytes, rank 1 expects 3 values"),
        "{other}"
    );
    let left = on_two_npus(|npu, c| {
        if c.rank() == 1 {
            return String::new(); // destroys its communicator
        }
        let mut x = npu.zeros(&[1], DType::F32).unwrap();
        let mut got = npu.zeros(&[1], DType::F32).unwrap();
        let e = c.all_reduce(&mut x, ReduceOp::Sum).unwrap_err().to_string();
        e + &c.recv(&mut got, 1).unwrap_err().to_string()
    });
    assert!(
        left[0].contains("HCCL_E_REMOTE") && left[0].contains("rank 1 destroyed its communicator"),
        "{left:?}"
    );
    std::env::set_var("HCCL_CONNECT_TIMEOUT", "1");
    let npu = Npu::open(0).unwrap();
    let alone = Hccl::join(&npu, 2, 0, &root_info().unwrap());
    let e = alone.err().unwrap().to_string();
    assert!(
        e.contains("HCCL_E_TIMEOUT") && e.contains("ranks [1] never joined"),
        "{e}"
    );
}
