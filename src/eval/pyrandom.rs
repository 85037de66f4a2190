//! CPython's `random.Random` seeded with an int, as far as the harness's few-shot sampler uses
//! it: the MT19937 generator ([`Mt19937`], seeded as `_randommodule.c`), `getrandbits`, `_randbelow` and
//! `Random.sample` (`Lib/random.py`, 3.x), so that `gsm8k`'s random 5 shots are the harness's
//! shots, draw for draw.

use crate::data::mt19937::Mt19937;

/// `random.Random(seed)`.
pub struct PyRandom {
    mt: Mt19937,
}

impl PyRandom {
    /// Seeded as `random.Random(seed)`: `init_by_array` over the 32-bit words of `|seed|`,
    /// least significant first.
    pub fn new(seed: u64) -> Self {
        let key: Vec<u32> = if seed >> 32 == 0 {
            vec![seed as u32]
        } else {
            vec![seed as u32, (seed >> 32) as u32]
        };
        PyRandom {
            mt: Mt19937::by_array(&key),
        }
    }

    /// `getrandbits(k)` for `k ≤ 32`.
    pub fn getrandbits(&mut self, k: u32) -> u32 {
        assert!(k <= 32, "getrandbits({k}) beyond one word is not ported");
        if k == 0 {
            return 0;
        }
        self.mt.next_u32() >> (32 - k)
    }

    /// `_randbelow(n)` (the getrandbits variant): rejection sampling on `n.bit_length()` bits.
    pub fn randbelow(&mut self, n: usize) -> usize {
        assert!(n > 0 && n <= u32::MAX as usize, "randbelow({n})");
        let k = usize::BITS - n.leading_zeros();
        loop {
            let r = self.getrandbits(k) as usize;
            if r < n {
                return r;
            }
        }
    }

    /// `sample(range(n), k)`: the indices `Random.sample` picks from an `n`-long population,
    /// by its pool method for small populations and its set method for large ones.
    pub fn sample(&mut self, n: usize, k: usize) -> Vec<usize> {
        assert!(k <= n, "sample larger than population");
        let mut setsize = 21usize;
        if k > 5 {
            setsize += 4usize.pow(((k * 3) as f64).log(4.0).ceil() as u32);
        }
        if n <= setsize {
            let mut pool: Vec<usize> = (0..n).collect();
            (0..k)
                .map(|i| {
                    let j = self.randbelow(n - i);
                    let picked = pool[j];
                    pool[j] = pool[n - i - 1];
                    picked
                })
                .collect()
        } else {
            let mut selected = std::collections::HashSet::new();
            (0..k)
                .map(|_| loop {
                    let j = self.randbelow(n);
                    if selected.insert(j) {
                        break j;
                    }
                })
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Expected values printed by CPython 3.11:
    //   r = random.Random(1234); [r.sample(range(7473), 5) for _ in range(3)]
    //   r = random.Random(0); [r.getrandbits(32) for _ in range(3)]
    //   r = random.Random(2**40 + 5); r.sample(range(10), 4), r.sample(range(100), 7)
    #[test]
    fn draws_equal_cpython() {
        let mut r = PyRandom::new(1234);
        let draws: Vec<Vec<usize>> = (0..3).map(|_| r.sample(7473, 5)).collect();
        assert_eq!(
            draws,
            [
                [6374, 3610, 957, 61, 742],
                [7462, 6610, 4769, 286, 5501],
                [5677, 687, 806, 6279, 2905]
            ]
        );
        let mut r = PyRandom::new(0);
        let bits: Vec<u32> = (0..3).map(|_| r.getrandbits(32)).collect();
        assert_eq!(bits, [3_626_764_237, 1_654_615_998, 3_255_389_356]);
        let mut r = PyRandom::new((1 << 40) + 5);
        assert_eq!(r.sample(10, 4), [8, 9, 4, 5]);
        assert_eq!(r.sample(100, 7), [3, 67, 97, 5, 21, 10, 17]);
    }
}
