//! The Mersenne Twister (MT19937) as the Python reference tools seed and draw from it, so that
//! what they randomise we randomise draw for draw:
//! - numpy's legacy `RandomState(seed)` (Megatron's GPTDataset shuffles): seeded by
//!   `init_genrand(seed)` (numpy `random/src/mt19937/mt19937.c`, `mt19937_seed`), shuffled by
//!   masked rejection sampling (numpy `random/mtrand.pyx` `_shuffle_raw`,
//!   `random/src/legacy/legacy-distributions.c` / `distributions.c` `random_interval`);
//! - CPython's `random.Random(seed)` (the harness's few-shot sampler): seeded by `init_by_array`
//!   over the seed's 32-bit words (CPython `Modules/_randommodule.c`).

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
}
