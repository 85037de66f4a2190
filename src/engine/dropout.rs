//! Dropout masks as pure functions of where an element sits: mindkit's own random bits for
//! training's hidden and attention dropout, the same on every backend, thread count and
//! parallel layout.
//!
//! Megatron draws its masks from torch's CUDA generators (megatron-core
//! megatron/core/tensor_parallel/random.py `CudaRNGStatesTracker`: the default generator
//! seeded `seed + 100·pp_rank`, the model-parallel one `seed + 2718 + tp_rank`), bits no other
//! program reproduces, and which change with the parallel layout (each tensor-parallel rank
//! draws its own attention-dropout stream). mindkit instead computes each mask element from
//! its **global** coordinates with a counter-based generator: (seed, the sample's index among
//! all samples the run consumed, global layer, site, global head and the query and key
//! positions — or the token position and hidden column), so that
//! - a TP/SP/PP/DP run draws exactly the masks of a single-rank run (a sequence-parallel rank
//!   draws its rows of the same mask, a tensor-parallel rank its heads'),
//! - the backward pass regenerates the attention mask instead of keeping it,
//! - a resumed run draws what the uninterrupted one drew with no generator state saved (the
//!   consumed-sample index is `(iteration − 1)·global batch + position in the batch`),
//! - and nothing depends on how work is split over threads.
//!
//! Legend: n = rows (tokens), w = a row's width.

/// Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3",
/// SC 2011; the generator behind torch's CUDA dropout too): four 32-bit words out of a
/// 128-bit counter under a 64-bit key, any element reachable without the ones before it.
/// Written out here because `rand` 0.9 has no counter-based generator (its ChaCha's word
/// position seeks a 64-word block stream, not a counter of our own coordinates) and these ten
/// rounds are all there is to it; the known-answer tests below are Random123's.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    const M0: u64 = 0xD251_1F53;
    const M1: u64 = 0xCD9E_8D57;
    const W0: u32 = 0x9E37_79B9;
    const W1: u32 = 0xBB67_AE85;
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let p0 = M0 * u64::from(c[0]);
        let p1 = M1 * u64::from(c[2]);
        c = [
            (p1 >> 32) as u32 ^ c[1] ^ k[0],
            p1 as u32,
            (p0 >> 32) as u32 ^ c[3] ^ k[1],
            p0 as u32,
        ];
    }
    c
}

/// A dropout probability above 0: an element is dropped where its 32 random bits fall below
/// `threshold` (probability `threshold / 2³²`, `p` rounded to a multiple of 2⁻³²), and a kept
/// one is multiplied by `scale = 1/(1 − p)` in f32 (inverted dropout, as
/// `torch.nn.functional.dropout`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    threshold: u32,
    scale: f32,
}

impl Rate {
    /// The rate of probability `p`; `None` for 0 (no dropout), or outside `[0, 1)`.
    pub fn new(p: f64) -> Option<Rate> {
        if !(p > 0.0 && p < 1.0) {
            return None;
        }
        let threshold = (p * 2f64.powi(32)).round().min(f64::from(u32::MAX)) as u32;
        Some(Rate {
            threshold,
            scale: (1.0 / (1.0 - p)) as f32,
        })
    }

    /// The factor of an element whose random bits are `bits`: 0 or `1/(1 − p)`.
    fn factor(self, bits: u32) -> f32 {
        if bits < self.threshold {
            0.0
        } else {
            self.scale
        }
    }
}

/// Where megatron-core applies dropout in a GPT model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Site {
    /// The embedding's output (`LanguageModelEmbedding.embedding_dropout`), `--hidden-dropout`.
    Embedding = 0,
    /// After the attention's output projection, before the residual sum (the layer's
    /// `self_attn_bda`), `--hidden-dropout`.
    AttentionOutput = 1,
    /// After the MLP, before the residual sum (`mlp_bda`), `--hidden-dropout`.
    MlpOutput = 2,
    /// The softmax probabilities inside core attention (`DotProductAttention.attention_dropout`),
    /// `--attention-dropout`.
    AttentionProbs = 3,
}

/// A row's place in the run: the index of its sample among all samples the run has consumed
/// (training's global order, whatever rank holds it) and the row's position in that sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowAt {
    /// The sample's consumed-sample index.
    pub sample: u64,
    /// The row's position in the sample (< 2²², which `--seq-length` is held to).
    pub position: u32,
}

/// Longest sequence an attention mask can key (the key position's counter bits).
pub const MAX_POSITIONS: usize = 1 << 22;
/// Most attention heads a mask can key.
pub const MAX_HEADS: usize = 1 << 12;
/// Most layers a mask can key.
pub const MAX_LAYERS: usize = 1 << 30;

/// One dropout mask: of a hidden-state tensor `[n, w]` (its rows' places in `rows`), or of an
/// attention's probabilities (`rows` then every row of the call, query and key alike, and
/// `first_head` the global index of the call's head 0 — a tensor-parallel rank's first).
///
/// Element bits: Philox with key `[seed, layer·4 + site]` and counter `[sample (low, high
/// word), position, column / 4]` (hidden; word `column % 4` of the four) or `[sample,
/// query position, head·2²⁰ + key position / 4]` (attention; word `key position % 4`).
#[derive(Debug, Clone, Copy)]
pub struct Mask<'a> {
    /// `--seed`.
    pub seed: u32,
    /// The probability.
    pub rate: Rate,
    /// The global layer index (0 for the embedding).
    pub layer: usize,
    /// Where in the model.
    pub site: Site,
    /// Each row's place.
    pub rows: &'a [RowAt],
    /// The global index of the first head (attention only).
    pub first_head: usize,
}

impl Mask<'_> {
    fn key(&self) -> [u32; 2] {
        [self.seed, ((self.layer as u32) << 2) | self.site as u32]
    }

    /// `x ·= factor` over row `row`'s columns `x [w]` (a hidden-state mask).
    pub fn scale_row(&self, row: usize, x: &mut [f32]) {
        let at = self.rows[row];
        let key = self.key();
        for (block, values) in x.chunks_mut(4).enumerate() {
            let counter = [
                at.sample as u32,
                (at.sample >> 32) as u32,
                at.position,
                block as u32,
            ];
            let bits = philox4x32_10(counter, key);
            for (v, b) in values.iter_mut().zip(bits) {
                *v *= self.rate.factor(b);
            }
        }
    }

    /// `probs ·= factor` for query row `query` of head `head` (of this call) over the key rows
    /// `keys..keys + probs.len()` (an attention mask).
    pub fn scale_probs(&self, head: usize, query: usize, keys: usize, probs: &mut [f32]) {
        let at = self.rows[query];
        let key = self.key();
        let head = ((self.first_head + head) as u32) << 20;
        let mut drawn = (u32::MAX, [0u32; 4]);
        for (p, k) in probs.iter_mut().zip(&self.rows[keys..]) {
            let block = k.position >> 2;
            if drawn.0 != block {
                let counter = [
                    at.sample as u32,
                    (at.sample >> 32) as u32,
                    at.position,
                    head | block,
                ];
                drawn = (block, philox4x32_10(counter, key));
            }
            *p *= self.rate.factor(drawn.1[(k.position & 3) as usize]);
        }
    }

    /// The factors of one sequence's attention probabilities `[heads, len, kv_len]`, row-major:
    /// its queries are rows `first..first + len` of the call, its keys `first..first + kv_len`
    /// (for a device that multiplies by an uploaded mask).
    pub fn attention_factors(
        &self,
        heads: usize,
        first: usize,
        (len, kv_len): (usize, usize),
    ) -> Vec<f32> {
        let mut out = vec![1f32; heads * len * kv_len];
        for (at, row) in out.chunks_mut(kv_len.max(1)).enumerate() {
            self.scale_probs(at / len, first + at % len, first, row);
        }
        out
    }

    /// The factors of every element of a hidden-state tensor `[rows, w]`, row-major (for a
    /// device that multiplies by an uploaded mask).
    pub fn factors(&self, w: usize) -> Vec<f32> {
        let mut out = vec![1f32; self.rows.len() * w];
        for (row, values) in out.chunks_mut(w.max(1)).enumerate() {
            self.scale_row(row, values);
        }
        out
    }
}

/// The random streams of an MoE router in training, apart from dropout's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterDraw {
    /// The input jitter's factors (`--moe-input-jitter-eps`), one per hidden column.
    Jitter = 0,
    /// SparseMixer's sampling ([`crate::arch::moe::sparsemixer`]).
    SparseMixer = 1,
}

/// `n` uniform draws in (0, 1) of the row at `at` for layer `layer`'s router stream `stream`:
/// Philox with key `[!seed, layer·4 + stream]` (dropout's keys take `seed` itself) and counter
/// `[sample (low, high word), position, i / 4]`, word `i % 4`, its top 24 bits centred in their
/// interval — as dropout's, the same on every backend, thread count and parallel layout.
pub fn router_uniforms(
    seed: u32,
    layer: usize,
    stream: RouterDraw,
    at: RowAt,
    n: usize,
) -> Vec<f32> {
    let key = [!seed, ((layer as u32) << 2) | stream as u32];
    let mut out = Vec::with_capacity(n);
    for block in 0..n.div_ceil(4) {
        let counter = [
            at.sample as u32,
            (at.sample >> 32) as u32,
            at.position,
            block as u32,
        ];
        for bits in philox4x32_10(counter, key) {
            out.push(((bits >> 8) as f32 + 0.5) / (1u32 << 24) as f32);
        }
    }
    out.truncate(n);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn router_draws_are_uniform_inside_the_unit_interval_and_keyed_by_place_and_stream() {
        let at = RowAt {
            sample: 7,
            position: 3,
        };
        let u = router_uniforms(42, 2, RouterDraw::SparseMixer, at, 4099);
        assert!(u.iter().all(|&x| x > 0.0 && x < 1.0));
        let mean = u.iter().map(|&x| x as f64).sum::<f64>() / u.len() as f64;
        assert!((mean - 0.5).abs() < 0.02, "{mean}");
        assert_eq!(
            u[..10],
            router_uniforms(42, 2, RouterDraw::SparseMixer, at, 10)[..]
        );
        // above or below a half, against the same elsewhere
        let half =
            |v: &[f32]| -> Vec<f32> { v.iter().map(|&x| f32::from(u8::from(x > 0.5))).collect() };
        let elsewhere = [
            router_uniforms(42, 2, RouterDraw::Jitter, at, 256),
            router_uniforms(42, 3, RouterDraw::SparseMixer, at, 256),
            router_uniforms(43, 2, RouterDraw::SparseMixer, at, 256),
            router_uniforms(
                42,
                2,
                RouterDraw::SparseMixer,
                RowAt { position: 4, ..at },
                256,
            ),
        ];
        for other in elsewhere {
            let c = correlation(&half(&u[..256]), &half(&other));
            assert!(c.abs() < 0.3, "{c}");
        }
    }

    #[test]
    fn philox_matches_random123_known_answers() {
        let cases = [
            (
                [0; 4],
                [0; 2],
                [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8],
            ),
            (
                [u32::MAX; 4],
                [u32::MAX; 2],
                [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd],
            ),
            (
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0],
                [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1],
            ),
        ];
        for (counter, key, want) in cases {
            assert_eq!(philox4x32_10(counter, key), want, "{counter:x?} {key:x?}");
        }
    }

    fn rows(samples: u64, len: u32) -> Vec<RowAt> {
        (0..samples)
            .flat_map(|sample| (0..len).map(move |position| RowAt { sample, position }))
            .collect()
    }

    fn hidden<'a>(rows: &'a [RowAt], p: f64, layer: usize, site: Site) -> Mask<'a> {
        Mask {
            seed: 1234,
            rate: Rate::new(p).unwrap(),
            layer,
            site,
            rows,
            first_head: 0,
        }
    }

    /// `(dropped, n)` over factors, each 0 or exactly `scale`.
    fn count(factors: &[f32], scale: f32) -> (usize, usize) {
        for &f in factors {
            assert!(
                f == 0.0 || f == scale,
                "factor {f} is neither 0 nor {scale}"
            );
        }
        (factors.iter().filter(|&&f| f == 0.0).count(), factors.len())
    }

    /// The dropped fraction lies within 5σ of p.
    fn within_binomial_bound((dropped, n): (usize, usize), p: f64) {
        let sigma = (n as f64 * p * (1.0 - p)).sqrt();
        let dev = (dropped as f64 - n as f64 * p).abs();
        assert!(dev < 5.0 * sigma, "{dropped} of {n} dropped, p = {p}");
    }

    /// Pearson correlation of two masks' keep indicators.
    fn correlation(a: &[f32], b: &[f32]) -> f64 {
        let n = a.len() as f64;
        let (x, y): (Vec<f64>, Vec<f64>) = a
            .iter()
            .zip(b)
            .map(|(a, b)| {
                (
                    f64::from(u8::from(*a != 0.0)),
                    f64::from(u8::from(*b != 0.0)),
                )
            })
            .unzip();
        let (mx, my) = (x.iter().sum::<f64>() / n, y.iter().sum::<f64>() / n);
        let cov: f64 = x.iter().zip(&y).map(|(a, b)| (a - mx) * (b - my)).sum();
        let vx: f64 = x.iter().map(|a| (a - mx).powi(2)).sum();
        let vy: f64 = y.iter().map(|b| (b - my).powi(2)).sum();
        cov / (vx * vy).sqrt()
    }

    #[test]
    fn hidden_masks_drop_a_binomial_fraction_and_scale_kept_values_exactly() {
        let at = rows(8, 256);
        for p in [0.1, 0.5, 0.01] {
            let mask = hidden(&at, p, 3, Site::MlpOutput);
            let scale = (1.0 / (1.0 - p)) as f32;
            within_binomial_bound(count(&mask.factors(300), scale), p);
        }
    }

    #[test]
    fn masks_of_other_sites_layers_samples_and_seeds_are_uncorrelated() {
        let at = rows(4, 128);
        let base = hidden(&at, 0.1, 2, Site::AttentionOutput).factors(256);
        let later: Vec<RowAt> = at
            .iter()
            .map(|r| RowAt {
                sample: r.sample + 4,
                ..*r
            })
            .collect();
        let others = [
            hidden(&at, 0.1, 2, Site::MlpOutput).factors(256),
            hidden(&at, 0.1, 3, Site::AttentionOutput).factors(256),
            hidden(&later, 0.1, 2, Site::AttentionOutput).factors(256),
            Mask {
                seed: 1235,
                ..hidden(&at, 0.1, 2, Site::AttentionOutput)
            }
            .factors(256),
        ];
        // 131072 elements: the correlation of independent masks has σ ≈ 0.0028.
        for (i, other) in others.iter().enumerate() {
            let r = correlation(&base, other);
            assert!(r.abs() < 0.014, "mask {i}: correlation {r}");
        }
        // Same coordinates, same mask.
        assert_eq!(
            base,
            hidden(&at, 0.1, 2, Site::AttentionOutput).factors(256)
        );
    }

    #[test]
    fn attention_masks_key_global_heads_and_positions() {
        let at = rows(2, 64);
        let mask = Mask {
            first_head: 0,
            ..hidden(&at, 0.1, 1, Site::AttentionProbs)
        };
        let row = |m: &Mask, head, query: usize| {
            let mut probs = vec![1f32; query % 64 + 1];
            m.scale_probs(head, query, query - query % 64, &mut probs);
            probs
        };
        let mut all = Vec::new();
        for head in 0..8 {
            for query in 0..128 {
                all.extend(row(&mask, head, query));
            }
        }
        within_binomial_bound(count(&all, (1.0 / 0.9f64) as f32), 0.1);
        // A tensor-parallel rank holding heads 4.. draws head 4's mask as its head 0.
        let second = Mask {
            first_head: 4,
            ..mask
        };
        assert_eq!(row(&second, 0, 100), row(&mask, 4, 100));
        // A key's factor depends on its position, not on where the key range starts.
        let mut tail = vec![1f32; 10];
        mask.scale_probs(2, 100, 80, &mut tail);
        assert_eq!(tail, row(&mask, 2, 100)[16..26]);
    }
}
