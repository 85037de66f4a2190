//! The Mersenne Twister (MT19937) as the Python reference tools seed and draw from it, so that
//! what they randomise we randomise draw for draw:
//! - numpy's legacy `RandomState(seed)` (Megatron's GPTDataset shuffles): seeded by
//!   `init_genrand(seed)` (numpy `random/src/mt19937/mt19937.c`, `mt19937_seed`), shuffled by
//!   masked rejection sampling (numpy `random/mtrand.pyx` `_shuffle_raw`,
//!   `random/src/legacy/legacy-distributions.c` / `distributions.c` `random_interval`);
//! - CPython's `random.Random(seed)` (the harness's few-shot sampler): seeded by `init_by_array`
//!   over the seed's 32-bit words (CPython `Modules/_randommodule.c`);
//! - torch's CPU generator after `torch.Generator().manual_seed(seed)` and `torch.randperm(n,
//!   generator=g)` (Megatron's `--dataloader-type cyclic` sampler): `at::mt19937(seed)` is
//!   `init_genrand` of the seed's low 32 bits (aten/src/ATen/core/MT19937RNGEngine.h);
//!   `randperm_cpu` (aten/src/ATen/native/TensorFactories.cpp) swaps position i with
//!   `i + random() % (n − i)` below `u32::MAX / 20` elements, and from there on builds the
//!   permutation inside out with `random64() % (i + 1)`, `random64()` being two 32-bit draws,
//!   the first the high word (CPUGeneratorImpl.cpp).

/// MT19937 state size.
const N: usize = 624;
const M: usize = 397;

/// An MT19937 generator.
#[derive(Clone)]
pub struct Mt19937 {
    state: [u32; N],
    index: usize,
}

impl Mt19937 {
    /// Seeded by `init_genrand(seed)`: numpy's `RandomState(seed)` for `seed < 2³²`.
    pub fn numpy(seed: u32) -> Self {
        let mut r = Mt19937 {
            state: [0; N],
            index: N,
        };
        r.init_genrand(seed);
        r
    }

    /// Seeded by `init_by_array(key)`: CPython's `random.Random` seeding.
    pub fn by_array(key: &[u32]) -> Self {
        let mut r = Mt19937 {
            state: [0; N],
            index: N,
        };
        r.init_by_array(key);
        r
    }

    /// torch's CPU generator after `manual_seed(seed)`: `init_genrand` of the low 32 bits (torch
    /// keeps the 64-bit seed only to report it).
    pub fn torch(seed: u64) -> Self {
        Self::numpy(seed as u32)
    }

    fn init_genrand(&mut self, seed: u32) {
        self.state[0] = seed;
        for i in 1..N {
            let prev = self.state[i - 1];
            self.state[i] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(i as u32);
        }
        self.index = N;
    }

    fn init_by_array(&mut self, key: &[u32]) {
        self.init_genrand(19_650_218);
        let (mut i, mut j) = (1usize, 0usize);
        for _ in 0..N.max(key.len()) {
            let prev = self.state[i - 1];
            self.state[i] = (self.state[i] ^ (prev ^ (prev >> 30)).wrapping_mul(1_664_525))
                .wrapping_add(key[j])
                .wrapping_add(j as u32);
            i += 1;
            j += 1;
            if i >= N {
                self.state[0] = self.state[N - 1];
                i = 1;
            }
            if j >= key.len() {
                j = 0;
            }
        }
        for _ in 0..N - 1 {
            let prev = self.state[i - 1];
            self.state[i] = (self.state[i] ^ (prev ^ (prev >> 30)).wrapping_mul(1_566_083_941))
                .wrapping_sub(i as u32);
            i += 1;
            if i >= N {
                self.state[0] = self.state[N - 1];
                i = 1;
            }
        }
        self.state[0] = 0x8000_0000;
    }

    fn twist(&mut self) {
        const UPPER: u32 = 0x8000_0000;
        const LOWER: u32 = 0x7fff_ffff;
        for k in 0..N {
            let y = (self.state[k] & UPPER) | (self.state[(k + 1) % N] & LOWER);
            let mag = if y & 1 == 1 { 0x9908_b0df } else { 0 };
            self.state[k] = self.state[(k + M) % N] ^ (y >> 1) ^ mag;
        }
        self.index = 0;
    }

    /// `genrand_uint32`: the next tempered 32-bit output.
    pub fn next_u32(&mut self) -> u32 {
        if self.index >= N {
            self.twist();
        }
        let mut y = self.state[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// numpy's legacy `random_interval(max)`: uniform in `0..=max` by masked rejection
    /// sampling (32-bit draws up to `u32::MAX`, two words beyond, as numpy).
    pub fn numpy_interval(&mut self, max: u64) -> u64 {
        if max == 0 {
            return 0;
        }
        let mut mask = max;
        for shift in [1, 2, 4, 8, 16, 32] {
            mask |= mask >> shift;
        }
        loop {
            let v = if max <= u64::from(u32::MAX) {
                u64::from(self.next_u32()) & mask
            } else {
                ((u64::from(self.next_u32()) << 32) | u64::from(self.next_u32())) & mask
            };
            if v <= max {
                return v;
            }
        }
    }

    /// `torch.randperm(n, generator=g)` on the CPU with this generator as `g` (torch 2.9's
    /// `randperm_cpu`): below `u32::MAX / 20` elements a forward Fisher–Yates walk over
    /// `0..n` with `next_u32() % (n − i)` (the modulo's slight bias kept), from there on the
    /// inside-out variant with 64-bit draws.
    pub fn torch_randperm(&mut self, n: u64) -> Vec<u64> {
        let mut perm: Vec<u64> = (0..n).collect();
        if n < u64::from(u32::MAX / 20) {
            for i in 0..n.saturating_sub(1) {
                let z = u64::from(self.next_u32()) % (n - i);
                perm.swap(i as usize, (z + i) as usize);
            }
            return perm;
        }
        for i in 0..n {
            let high = u64::from(self.next_u32());
            let z = ((high << 32) | u64::from(self.next_u32())) % (i + 1);
            perm[i as usize] = perm[z as usize];
            perm[z as usize] = i;
        }
        perm
    }

    /// numpy's legacy `RandomState.shuffle` of a 1-D array, in place.
    pub fn numpy_shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.numpy_interval(i as u64) as usize;
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // numpy 1.26: np.random.RandomState(0).permutation(10) and the reference MT19937's first
    // output for seed 5489 (mt19937ar.c).
    #[test]
    fn numpy_shuffles_equal_numpy() {
        let mut r = Mt19937::numpy(0);
        let mut a: Vec<u32> = (0..10).collect();
        r.numpy_shuffle(&mut a);
        assert_eq!(a, [2, 8, 4, 9, 1, 6, 7, 3, 0, 5]);
        assert_eq!(Mt19937::numpy(5489).next_u32(), 3_499_211_612);
    }

    /// A permutation's first and last four entries and `Σ (i mod 1000003)·p[i] mod (2³¹ − 1)`
    /// over its positions i, as the expected values below were computed in Python.
    fn fingerprint(p: &[u64]) -> ([u64; 4], [u64; 4], u64) {
        let sum = (p.iter().enumerate())
            .map(|(i, &v)| (i as u64 % 1_000_003) * v % ((1 << 31) - 1))
            .sum();
        let n = p.len();
        (
            [p[0], p[1], p[2], p[3]],
            [p[n - 4], p[n - 3], p[n - 2], p[n - 1]],
            sum,
        )
    }

    // torch 2.9.1 (CPU): torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    #[test]
    fn torch_randperm_equals_torch() {
        let perm = |seed: u64, n: u64| Mt19937::torch(seed).torch_randperm(n);
        let small: [(u64, [&[u64]; 5]); 4] = [
            (
                0,
                [
                    &[],
                    &[0],
                    &[0, 1],
                    &[4, 0, 5, 3, 2, 6, 1],
                    &[4, 1, 7, 5, 3, 9, 0, 8, 6, 2],
                ],
            ),
            (
                1,
                [
                    &[],
                    &[0],
                    &[1, 0],
                    &[0, 6, 1, 3, 5, 2, 4],
                    &[5, 6, 1, 2, 0, 8, 9, 3, 7, 4],
                ],
            ),
            (
                1234,
                [
                    &[],
                    &[0],
                    &[1, 0],
                    &[6, 4, 3, 1, 0, 5, 2],
                    &[5, 4, 8, 2, 6, 9, 1, 7, 0, 3],
                ],
            ),
            // torch keeps the seed's low 32 bits: 2³² + 5 draws as 5 does
            (
                (1 << 32) + 5,
                [
                    &[],
                    &[0],
                    &[1, 0],
                    &[1, 0, 4, 2, 6, 5, 3],
                    &[1, 4, 9, 6, 3, 5, 0, 2, 8, 7],
                ],
            ),
        ];
        for (seed, expected) in small {
            for (n, want) in [0, 1, 2, 7, 10].into_iter().zip(expected) {
                assert_eq!(perm(seed, n), want, "seed {seed} n {n}");
            }
        }
        type Print = ([u64; 4], [u64; 4], u64);
        let large: [(u64, u64, Print); 8] = [
            (
                0,
                1000,
                ([44, 37, 675, 775], [932, 745, 263, 354], 251_667_852),
            ),
            (
                0,
                100_000,
                (
                    [36044, 73702, 76369, 2549],
                    [70481, 47534, 99934, 84786],
                    90_009_501_508_039,
                ),
            ),
            (
                1,
                1000,
                ([845, 303, 66, 436], [364, 513, 935, 639], 250_929_158),
            ),
            (
                1,
                100_000,
                (
                    [95845, 18969, 32002, 23533],
                    [83320, 75609, 36467, 61140],
                    89_763_932_140_901,
                ),
            ),
            (
                1234,
                1000,
                ([775, 760, 390, 842], [450, 478, 173, 804], 252_444_433),
            ),
            (
                1234,
                100_000,
                (
                    [69775, 70546, 90246, 94746],
                    [41956, 31366, 3720, 64918],
                    89_843_958_290_640,
                ),
            ),
            (
                (1 << 32) + 5,
                1000,
                ([411, 49, 291, 695], [226, 389, 935, 655], 253_045_579),
            ),
            (
                (1 << 32) + 5,
                100_000,
                (
                    [53411, 99184, 41565, 33006],
                    [2466, 82440, 5805, 57622],
                    89_758_601_852_779,
                ),
            ),
        ];
        for (seed, n, want) in large {
            assert_eq!(fingerprint(&perm(seed, n)), want, "seed {seed} n {n}");
        }
    }

    // torch 2.9.1, as above, on both sides of the switch to the inside-out walk at
    // u32::MAX / 20 = 214748364 elements (1.7 GB each; some ten seconds apiece in release).
    #[test]
    #[ignore = "draws four permutations of 214 million elements"]
    fn torch_randperm_equals_torch_past_its_switch_to_64_bit_draws() {
        type Print = ([u64; 4], [u64; 4], u64);
        let cases: [(u64, u64, Print); 4] = [
            (
                0,
                214_748_363,
                (
                    [209652414, 184016258, 65237881, 190120003],
                    [97841722, 3969528, 51934543, 53763082],
                    230_585_613_869_884_687,
                ),
            ),
            (
                3,
                214_748_363,
                (
                    [3426993, 89012687, 34994685, 171579910],
                    [2149681, 40745462, 212516164, 92186696],
                    230_580_595_708_278_926,
                ),
            ),
            (
                0,
                214_748_364,
                (
                    [180140102, 136514640, 18739608, 22357822],
                    [60523199, 10659741, 142775043, 79202631],
                    230_574_951_973_732_917,
                ),
            ),
            (
                3,
                214_748_364,
                (
                    [50815193, 116864026, 18612126, 8421410],
                    [15019188, 108813077, 122959525, 138283752],
                    230_584_655_938_982_272,
                ),
            ),
        ];
        for (seed, n, want) in cases {
            let got = fingerprint(&Mt19937::torch(seed).torch_randperm(n));
            assert_eq!(got, want, "seed {seed} n {n}");
        }
    }
}
