//! The order in which a pipeline stage runs its forward and backward passes and talks to its
//! neighbours during one iteration, as megatron-core's schedules give it
//! (megatron/core/pipeline_parallel/schedules.py): 1F1B
//! (`forward_backward_pipelining_without_interleaving`) with one model chunk per stage, the
//! interleaved 1F1B schedule (`forward_backward_pipelining_with_interleaving`, its default
//! overlapped path: an activation exchange after each forward pass, a gradient exchange after
//! each backward pass) with several. A schedule is a plain list of [`Op`]s per stage; the
//! trainer runs it, and the tests here run every stage's list against the others to check that
//! each received tensor is the one its sender meant.
//!
//! With `V` model chunks per stage the pipeline is a ring: the last stage's chunk `v` feeds the
//! first stage's chunk `v + 1`, and the first stage's chunk `v + 1` hands its input's gradient
//! back to the last stage's chunk `v`.

/// A forward or backward pass's place: `(model chunk, micro-batch)`.
pub type Slot = (usize, usize);

/// One action of a stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Run the forward pass of a model chunk on a micro-batch.
    Forward(Slot),
    /// Run the backward pass of a model chunk on a micro-batch (its forward pass ran before).
    Backward(Slot),
    /// Trade tensors with the neighbouring stages.
    Exchange(Exchange),
}

/// Megatron's point-to-point step (p2p_communication.py `_communicate`): sends of tensors this
/// stage made and receives of tensors for slots it will run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Exchange {
    /// The output of this slot's forward pass goes to the next stage.
    pub send_next: Option<Slot>,
    /// The input of this slot comes from the previous stage.
    pub recv_prev: Option<Slot>,
    /// The input gradient of this slot's backward pass goes to the previous stage.
    pub send_prev: Option<Slot>,
    /// The output gradient of this slot comes from the next stage.
    pub recv_next: Option<Slot>,
}

impl Exchange {
    fn is_empty(&self) -> bool {
        *self == Exchange::default()
    }
}

/// A pipeline of `stages` stages holding `chunks` model chunks each, running `micro` micro-
/// batches, seen from `stage`.
#[derive(Debug, Clone, Copy)]
pub struct Pipeline {
    /// Pipeline stages (PP).
    pub stages: usize,
    /// Model chunks per stage (the virtual pipeline size; 1 without).
    pub chunks: usize,
    /// Micro-batches of the iteration on this data-parallel rank.
    pub micro: usize,
    /// Micro-batches run through one chunk before the next chunk's turn
    /// (`--microbatch-group-size-per-virtual-pipeline-stage`, default PP).
    pub group: usize,
    /// This stage.
    pub stage: usize,
    /// MindSpeed's DualPipeV: two chunks in a V, chunk 0 flowing to the next stage and
    /// chunk 1 back to the previous one, the last stage handing its chunk 0's output to its
    /// own chunk 1, the first stage's chunk 1 ending the model.
    pub v_shape: bool,
}

impl Pipeline {
    /// Whether `chunk` here is the model's first (it reads the tokens, nothing before it).
    pub fn model_first(&self, chunk: usize) -> bool {
        self.stage == 0 && chunk == 0
    }

    /// Whether `chunk` here is the model's last (it computes the loss, nothing after it).
    pub fn model_last(&self, chunk: usize) -> bool {
        match self.v_shape {
            true => self.stage == 0 && chunk == 1,
            false => self.stage + 1 == self.stages && chunk + 1 == self.chunks,
        }
    }

    /// The stage `chunk`'s forward output goes to (and its output gradient comes from).
    pub fn downstream(&self, chunk: usize) -> usize {
        match self.v_shape && chunk == 1 {
            true => self.stage.saturating_sub(1),
            false => (self.stage + 1) % self.stages,
        }
    }

    /// The stage `chunk`'s forward input comes from (and its input gradient goes to).
    pub fn upstream(&self, chunk: usize) -> usize {
        match self.v_shape && chunk == 1 {
            true => (self.stage + 1).min(self.stages - 1),
            false => (self.stage + self.stages - 1) % self.stages,
        }
    }

    /// The chunk of this stage that takes `chunk`'s forward output as its input, where the
    /// V turns: the last stage's chunk 1 takes its chunk 0's (whose output gradient is, in
    /// turn, chunk 1's input gradient).
    pub fn turns(&self, chunk: usize) -> Option<usize> {
        (self.v_shape && self.stage + 1 == self.stages && chunk == 0).then_some(1)
    }

    /// The chunk whose forward output `chunk` takes as its input where the V turns (the
    /// inverse of [`Pipeline::turns`]).
    pub fn turned_from(&self, chunk: usize) -> Option<usize> {
        (self.v_shape && self.stage + 1 == self.stages && chunk == 1).then_some(0)
    }

    /// Whether `chunk`'s input comes from another stage (and its input gradient goes there).
    fn fed_by_peer(&self, chunk: usize) -> bool {
        !self.model_first(chunk) && self.turned_from(chunk).is_none()
    }

    /// Whether `chunk`'s output goes to another stage (and its output gradient comes from it).
    fn feeds_peer(&self, chunk: usize) -> bool {
        !self.model_last(chunk) && self.turns(chunk).is_none()
    }

    /// The stage's schedule: every micro-batch forward through each of its chunks and, when
    /// `train`, backward again, with the exchanges between them.
    pub fn ops(&self, train: bool) -> Vec<Op> {
        let mut b = Builder {
            p: *self,
            ops: Vec::new(),
            inputs: vec![0; self.chunks],
            grads: vec![0; self.chunks],
        };
        match (self.v_shape, self.chunks) {
            (true, _) => b.v_forward_then_backward(train),
            (false, 1) => b.one_f_one_b(train),
            (false, _) => b.interleaved(train),
        }
        b.ops
            .retain(|op| !matches!(op, Op::Exchange(x) if x.is_empty()));
        b.ops
    }

    /// Warm-up forward passes before the first backward pass (megatron-core
    /// `get_pp_rank_microbatches`): PP − stage − 1 in 1F1B; with chunks, 2·(PP − stage − 1)
    /// plus (V − 1)·group; all when only forward.
    pub fn warmup(&self, train: bool) -> usize {
        let total = self.micro * self.chunks;
        let behind = self.stages - self.stage - 1;
        let n = match (train, self.chunks) {
            (false, _) => total,
            (true, 1) => behind,
            (true, v) => 2 * behind + (v - 1) * self.group,
        };
        n.min(total)
    }

    /// (micro-batch, chunk) of the `k`-th forward pass (megatron-core `get_schedule_table`):
    /// groups of `group` micro-batches through chunk 0, then the same through chunk 1, …;
    /// the last group takes the remaining micro-batches.
    fn table(&self, k: usize) -> (usize, usize) {
        let per_group = self.group * self.chunks;
        let (g, at) = (k / per_group, k % per_group);
        let start = g * self.group;
        let size = match start + self.group >= self.micro {
            true => self.micro - start,
            false => self.group,
        };
        (start + at % size, at / size)
    }

    /// The chunk of the `k`-th forward pass, or of the `k`-th backward pass (chunks backward
    /// in reverse order), `k` taken modulo all passes (`get_model_chunk_id`).
    fn chunk(&self, k: usize, forward: bool) -> usize {
        let c = self.table(k % (self.micro * self.chunks)).1;
        match forward {
            true => c,
            false => self.chunks - 1 - c,
        }
    }

    /// Whether, after its `k`-th forward (or backward) pass, this stage receives an activation
    /// (or gradient), and for which chunk (`recv_tensor_from_previous_stage`). The leading
    /// stage — the first going forward, the last going backward — is PP − 1 passes ahead of
    /// the stage that feeds it round the ring, which sends nothing out of its final chunk.
    fn receives(&self, k: usize, forward: bool) -> Option<usize> {
        let leading = match forward {
            true => self.stage == 0,
            false => self.stage + 1 == self.stages,
        };
        if !leading {
            return Some(self.chunk(k + 1, forward));
        }
        let behind = self.stages - 1;
        let end = if forward { self.chunks - 1 } else { 0 };
        let feeder = match k < behind {
            true => None,
            false => Some(self.chunk(k - behind, forward)),
        };
        let c = feeder.filter(|&c| c != end)?;
        Some(if forward { c + 1 } else { c - 1 })
    }
}

/// Builds one stage's list, numbering received tensors by the micro-batches they serve (each
/// chunk runs its micro-batches in order, forward and backward).
struct Builder {
    p: Pipeline,
    ops: Vec<Op>,
    /// Inputs received so far, per chunk.
    inputs: Vec<usize>,
    /// Output gradients received so far, per chunk.
    grads: Vec<usize>,
}

impl Builder {
    /// The next input of `chunk` from the previous stage, if `wanted`.
    fn recv_prev(&mut self, chunk: usize, wanted: bool) -> Option<Slot> {
        let m = self.inputs[chunk];
        self.inputs[chunk] += usize::from(wanted);
        wanted.then_some((chunk, m))
    }

    /// The next output gradient of `chunk` from the next stage, if `wanted`.
    fn recv_next(&mut self, chunk: usize, wanted: bool) -> Option<Slot> {
        let m = self.grads[chunk];
        self.grads[chunk] += usize::from(wanted);
        wanted.then_some((chunk, m))
    }

    fn exchange(&mut self, x: Exchange) {
        self.ops.push(Op::Exchange(x));
    }

    /// The forward pass of `slot`, its output sent on unless the model ends there.
    fn send_next(&self, slot: Slot) -> Option<Slot> {
        (!self.p.model_last(slot.0)).then_some(slot)
    }

    /// Its input's gradient sent back unless the model starts there.
    fn send_prev(&self, slot: Slot) -> Option<Slot> {
        (!self.p.model_first(slot.0)).then_some(slot)
    }

    /// DualPipeV's V (mindspeed/core/pipeline_parallel/dualpipev), run as every micro-batch
    /// forward through chunk 0, then through chunk 1, then backward through chunk 1 and
    /// chunk 0: each phase a chain along the V in micro-batch order, so no stage waits on one
    /// that waits on it. The passes and their sums are DualPipeV's; its order, overlapping one
    /// chunk's forward with the other's backward to hold fewer activations, is not.
    fn v_forward_then_backward(&mut self, train: bool) {
        let (p, n) = (self.p, self.p.micro);
        for c in 0..2 {
            for m in 0..n {
                // chunk 0 takes the previous stage's output, chunk 1 the next stage's (or, on
                // the last stage, its own chunk 0's)
                let from = self.recv_prev(c, p.fed_by_peer(c));
                self.exchange(Exchange {
                    recv_prev: from,
                    ..Exchange::default()
                });
                self.ops.push(Op::Forward((c, m)));
                let onward = p.feeds_peer(c);
                self.exchange(Exchange {
                    send_next: onward.then_some((c, m)),
                    ..Exchange::default()
                });
            }
        }
        if !train {
            return;
        }
        for c in [1, 0] {
            for m in 0..n {
                let from = self.recv_next(c, p.feeds_peer(c));
                self.exchange(Exchange {
                    recv_next: from,
                    ..Exchange::default()
                });
                self.ops.push(Op::Backward((c, m)));
                let back = p.fed_by_peer(c);
                self.exchange(Exchange {
                    send_prev: back.then_some((c, m)),
                    ..Exchange::default()
                });
            }
        }
    }

    /// `forward_backward_pipelining_without_interleaving`.
    fn one_f_one_b(&mut self, train: bool) {
        let (n, warmup) = (self.p.micro, self.p.warmup(train));
        let (first, last) = (self.p.model_first(0), self.p.model_last(0));
        for i in 0..warmup {
            let recv_prev = self.recv_prev(0, !first);
            self.exchange(Exchange {
                recv_prev,
                ..Exchange::default()
            });
            self.ops.push(Op::Forward((0, i)));
            let send_next = self.send_next((0, i));
            self.exchange(Exchange {
                send_next,
                ..Exchange::default()
            });
        }
        let recv_prev = self.recv_prev(0, warmup < n && !first);
        self.exchange(Exchange {
            recv_prev,
            ..Exchange::default()
        });
        for i in 0..n - warmup {
            let j = warmup + i;
            self.ops.push(Op::Forward((0, j)));
            let send_next = self.send_next((0, j));
            let recv_next = self.recv_next(0, !last);
            self.exchange(Exchange {
                send_next,
                recv_next,
                ..Exchange::default()
            });
            self.ops.push(Op::Backward((0, i)));
            let recv_prev = self.recv_prev(0, j + 1 < n && !first);
            let send_prev = self.send_prev((0, i));
            self.exchange(Exchange {
                send_prev,
                recv_prev,
                ..Exchange::default()
            });
        }
        for i in (n - warmup..n).filter(|_| train) {
            let recv_next = self.recv_next(0, !last);
            self.exchange(Exchange {
                recv_next,
                ..Exchange::default()
            });
            self.ops.push(Op::Backward((0, i)));
            let send_prev = self.send_prev((0, i));
            self.exchange(Exchange {
                send_prev,
                ..Exchange::default()
            });
        }
    }

    /// `forward_backward_pipelining_with_interleaving`, p2p overlapped (Megatron's default
    /// with virtual stages): each pass followed by its own exchange.
    fn interleaved(&mut self, train: bool) {
        let p = self.p;
        let total = p.micro * p.chunks;
        let warmup = p.warmup(train);
        let remaining = total - warmup;
        let recv_prev = self.recv_prev(0, !p.model_first(0));
        self.exchange(Exchange {
            recv_prev,
            ..Exchange::default()
        });
        for k in 0..warmup {
            self.forward_step(k, k + 1 == total);
        }
        let last_stage = p.stage + 1 == p.stages;
        // the first backward pass's output gradient (for the last chunk), received after the
        // warm-up's last forward pass or, with no steady state, before the cooldown
        let recv_next = self.recv_next(p.chunks - 1, train && !last_stage);
        self.exchange(Exchange {
            recv_next,
            ..Exchange::default()
        });
        for k in 0..remaining {
            self.forward_step(warmup + k, warmup + k + 1 == total);
            self.backward_step(k, false);
        }
        if !train {
            return;
        }
        for k in remaining..total {
            self.backward_step(k, k + 1 == total);
        }
    }

    /// The `k`-th forward pass and its exchange: its output out, the next input in (none
    /// after the `last` one).
    fn forward_step(&mut self, k: usize, last: bool) {
        let slot = self.p.table(k);
        let slot = (slot.1, slot.0);
        self.ops.push(Op::Forward(slot));
        let send_next = self.send_next(slot);
        let from = self.p.receives(k, true).filter(|_| !last);
        let recv_prev = self.recv_prev(from.unwrap_or(0), from.is_some());
        self.exchange(Exchange {
            send_next,
            recv_prev,
            ..Exchange::default()
        });
    }

    /// The `k`-th backward pass and its exchange: its input's gradient out, the next output
    /// gradient in (none after the `last` one).
    fn backward_step(&mut self, k: usize, last: bool) {
        let chunk = self.p.chunk(k, false);
        let slot = (chunk, self.p.table(k).0);
        self.ops.push(Op::Backward(slot));
        let send_prev = self.send_prev(slot);
        let from = self.p.receives(k, false).filter(|_| !last);
        let recv_next = self.recv_next(from.unwrap_or(0), from.is_some());
        self.exchange(Exchange {
            send_prev,
            recv_next,
            ..Exchange::default()
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{HashMap, HashSet, VecDeque};

    /// What travels between stages: an activation or a gradient, and the slot it is for.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Message {
        Activation(Slot),
        Gradient(Slot),
    }

    /// Run every stage's schedule, sends buffered and receives waiting (as the communicators
    /// do), each exchange's four parts in `_p2p_ops`' even/odd order; check that every
    /// received tensor is the one meant for it, that each pass runs once with its inputs
    /// there, and that nothing waits forever.
    fn simulate(stages: usize, chunks: usize, micro: usize, group: usize, train: bool) {
        let lists: Vec<Vec<Op>> = (0..stages)
            .map(|stage| {
                let p = Pipeline {
                    stages,
                    chunks,
                    micro,
                    group,
                    stage,
                    v_shape: false,
                };
                p.ops(train)
            })
            .collect();
        let case = format!("PP {stages} V {chunks} micro {micro} group {group} train {train}");
        let mut channels: HashMap<(usize, usize), VecDeque<Message>> = HashMap::new();
        // per stage: next op, and how many parts of a current exchange are done
        let mut at = vec![(0usize, 0usize); stages];
        let mut inputs: Vec<HashSet<Slot>> = vec![HashSet::new(); stages];
        let mut grads: Vec<HashSet<Slot>> = vec![HashSet::new(); stages];
        let mut forwarded: Vec<HashSet<Slot>> = vec![HashSet::new(); stages];
        let mut backwarded: Vec<HashSet<Slot>> = vec![HashSet::new(); stages];
        let next = |s: usize| (s + 1) % stages;
        let prev = |s: usize| (s + stages - 1) % stages;
        loop {
            let mut moved = false;
            for s in 0..stages {
                let pipe = Pipeline {
                    stages,
                    chunks,
                    micro,
                    group,
                    stage: s,
                    v_shape: false,
                };
                while let Some(op) = lists[s].get(at[s].0).copied() {
                    match op {
                        Op::Forward(slot) => {
                            assert!(
                                pipe.model_first(slot.0) || inputs[s].remove(&slot),
                                "{case}: stage {s} runs forward {slot:?} without its input"
                            );
                            assert!(forwarded[s].insert(slot), "{case}: forward {slot:?} twice");
                        }
                        Op::Backward(slot) => {
                            assert!(
                                forwarded[s].contains(&slot),
                                "{case}: {slot:?} backward first"
                            );
                            assert!(
                                pipe.model_last(slot.0) || grads[s].remove(&slot),
                                "{case}: stage {s} runs backward {slot:?} without its gradient"
                            );
                            assert!(
                                backwarded[s].insert(slot),
                                "{case}: backward {slot:?} twice"
                            );
                        }
                        Op::Exchange(x) => {
                            let order: [u8; 4] = match s % 2 {
                                0 => [0, 1, 2, 3],
                                _ => [1, 0, 3, 2],
                            };
                            while at[s].1 < 4 {
                                let part = order[at[s].1];
                                match part {
                                    0 => {
                                        if let Some((c, m)) = x.send_next {
                                            assert!(forwarded[s].contains(&(c, m)));
                                            let to =
                                                if s + 1 < stages { (c, m) } else { (c + 1, m) };
                                            (channels.entry((s, next(s))).or_default())
                                                .push_back(Message::Activation(to));
                                        }
                                    }
                                    2 => {
                                        if let Some((c, m)) = x.send_prev {
                                            assert!(backwarded[s].contains(&(c, m)));
                                            let to = if s > 0 { (c, m) } else { (c - 1, m) };
                                            (channels.entry((s, prev(s))).or_default())
                                                .push_back(Message::Gradient(to));
                                        }
                                    }
                                    _ => {
                                        let (want, from) = match part {
                                            1 => (x.recv_prev.map(Message::Activation), prev(s)),
                                            _ => (x.recv_next.map(Message::Gradient), next(s)),
                                        };
                                        if let Some(want) = want {
                                            let ch = channels.entry((from, s)).or_default();
                                            let Some(got) = ch.pop_front() else { break };
                                            assert_eq!(got, want, "{case}: stage {s} from {from}");
                                            match got {
                                                Message::Activation(slot) => inputs[s].insert(slot),
                                                Message::Gradient(slot) => grads[s].insert(slot),
                                            };
                                        }
                                    }
                                }
                                at[s].1 += 1;
                                moved = true;
                            }
                            if at[s].1 < 4 {
                                break;
                            }
                        }
                    }
                    at[s] = (at[s].0 + 1, 0);
                    moved = true;
                }
            }
            if at.iter().zip(&lists).all(|(a, l)| a.0 == l.len()) {
                break;
            }
            assert!(moved, "{case}: the stages wait for each other: {at:?}");
        }
        for s in 0..stages {
            assert_eq!(
                forwarded[s].len(),
                chunks * micro,
                "{case}: stage {s} forwards"
            );
            let backwards = if train { chunks * micro } else { 0 };
            assert_eq!(
                backwarded[s].len(),
                backwards,
                "{case}: stage {s} backwards"
            );
            assert!(
                inputs[s].is_empty() && grads[s].is_empty(),
                "{case}: unused tensors"
            );
        }
        assert!(
            channels.values().all(VecDeque::is_empty),
            "{case}: unread messages"
        );
    }

    #[test]
    fn every_stage_gets_the_tensors_meant_for_it() {
        for stages in 1..=4 {
            for micro in 1..=9 {
                simulate(stages, 1, micro, stages, true);
                simulate(stages, 1, micro, stages, false);
            }
        }
        for stages in 2..=4 {
            for chunks in 2..=3 {
                for micro in stages..=10 {
                    for group in stages..=micro {
                        let rest = micro % group;
                        if rest == 0 || rest >= stages {
                            simulate(stages, chunks, micro, group, true);
                            simulate(stages, chunks, micro, group, false);
                        }
                    }
                }
            }
        }
    }

    /// Every stage's DualPipeV list run against the others with blocking sends (a send waits
    /// for its receive): each pass once, in V order, with its input or gradient from the
    /// stage along the V (or the turn's own chunk), and nothing waits forever.
    #[test]
    fn dualpipev_runs_the_v_forward_then_backward_without_deadlock() {
        for (stages, micro) in [(2, 3), (3, 5), (4, 7)] {
            let pipe = |stage| Pipeline {
                stages,
                chunks: 2,
                micro,
                group: stages,
                stage,
                v_shape: true,
            };
            let lists: Vec<Vec<Op>> = (0..stages).map(|s| pipe(s).ops(true)).collect();
            let mut at = vec![0usize; stages];
            let mut have: Vec<HashSet<(bool, Slot)>> = vec![HashSet::new(); stages];
            let mut done: Vec<Vec<Op>> = vec![Vec::new(); stages];
            loop {
                let mut moved = false;
                for s in 0..stages {
                    let p = pipe(s);
                    let Some(&op) = lists[s].get(at[s]) else {
                        continue;
                    };
                    match op {
                        Op::Forward(slot @ (c, m)) => {
                            let ready = p.model_first(c)
                                || have[s].remove(&(false, slot))
                                || (p.turns(0) == Some(c)
                                    && done[s].contains(&Op::Forward((0, m))));
                            assert!(
                                ready,
                                "PP {stages} stage {s}: forward {slot:?} without input"
                            );
                        }
                        Op::Backward(slot @ (c, m)) => {
                            let ready = p.model_last(c)
                                || have[s].remove(&(true, slot))
                                || (p.turns(c) == Some(1)
                                    && done[s].contains(&Op::Backward((1, m))));
                            assert!(
                                ready,
                                "PP {stages} stage {s}: backward {slot:?} without gradient"
                            );
                        }
                        Op::Exchange(x) => {
                            // one part each; a send completes once its peer receives it
                            if let Some(slot) = x.recv_prev.or(x.recv_next) {
                                let grad = x.recv_next.is_some();
                                let from = match grad {
                                    false => p.upstream(slot.0),
                                    true => p.downstream(slot.0),
                                };
                                let sent = lists[from].get(at[from]).is_some_and(|o| {
                                    matches!(o, Op::Exchange(y) if match grad {
                                        false => y.send_next == Some(slot),
                                        true => y.send_prev == Some(slot),
                                    })
                                });
                                if !sent {
                                    continue;
                                }
                                have[s].insert((grad, slot));
                                at[from] += 1;
                            } else {
                                continue; // a send: its receiver moves it
                            }
                        }
                    }
                    done[s].push(op);
                    at[s] += 1;
                    moved = true;
                }
                if !moved {
                    break;
                }
            }
            for s in 0..stages {
                assert_eq!(
                    at[s],
                    lists[s].len(),
                    "PP {stages}: stage {s} stuck at {:?}",
                    lists[s].get(at[s])
                );
                let passes = done[s]
                    .iter()
                    .filter(|o| !matches!(o, Op::Exchange(_)))
                    .count();
                assert_eq!(passes, 4 * micro, "PP {stages} stage {s}");
            }
        }
    }

    #[test]
    fn megatrons_schedule_table_and_warmup() {
        // schedules.py's example: PP 2, N 3 (group), M 5 micro-batches, VP 2.
        let p = Pipeline {
            stages: 2,
            chunks: 2,
            micro: 5,
            group: 3,
            stage: 0,
            v_shape: false,
        };
        let table: Vec<_> = (0..10).map(|k| p.table(k)).collect();
        let micro: Vec<usize> = table.iter().map(|t| t.0).collect();
        let chunk: Vec<usize> = table.iter().map(|t| t.1).collect();
        assert_eq!(micro, [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]);
        assert_eq!(chunk, [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]);
        // (PP − rank − 1)·2 + (V − 1)·group
        assert_eq!(p.warmup(true), 2 + 3);
        assert_eq!(Pipeline { stage: 1, ..p }.warmup(true), 3);
        assert_eq!(p.warmup(false), 10);
        let one = Pipeline {
            chunks: 1,
            group: 2,
            ..p
        };
        assert_eq!(
            (one.warmup(true), Pipeline { stage: 1, ..one }.warmup(true)),
            (1, 0)
        );
    }
}
