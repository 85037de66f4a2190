//! The NPU backend's HCCL communicator on the CANN stand-in (whose libhccl side runs the
//! collectives across the ranks of this machine): ranks as threads, one stand-in device each,
//! give the same results, bit for bit, as the CPU backend's thread group.

mod common;

use mindkit::engine::comm::{Communicator, ReduceOp};
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
            .map(|c| s.spawn(move || exercise(&Cpu, &c)))
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
                    exercise(&npu, &c)
                })
            })
            .collect();
        ranks.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(on_npu, on_cpu);
    assert_eq!(on_cpu[1][0], [3.75, -9.0], "{on_cpu:?}");
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
