//! NumPy's legacy `numpy.random.RandomState`, as far as verl's seeded shuffles need it: the MT19937 generator
//! seeded from one 32-bit integer, the bounded draw `random_interval` and `shuffle`. Every draw equals NumPy's
//! bit for bit (tests/generations.rs checks it against the installed NumPy).

/// MT19937's state length.
const N: usize = 624;
/// MT19937's twist offset.
const M: usize = 397;
const MATRIX_A: u32 = 0x9908_b0df;
const UPPER_MASK: u32 = 0x8000_0000;
const LOWER_MASK: u32 = 0x7fff_ffff;

/// `numpy.random.RandomState(seed)` for an integer seed.
#[derive(Clone)]
pub struct RandomState {
    key: [u32; N],
    /// Next word of `key` to temper; `N` means the state must be twisted first.
    pos: usize,
}

impl std::fmt::Debug for RandomState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RandomState")
            .field("pos", &self.pos)
            .finish_non_exhaustive()
    }
}

impl RandomState {
    /// `RandomState(seed)`: NumPy seeds an integer with MT19937's reference `init_genrand` (Knuth's
    /// multiplier), not with `init_by_array` as Python's `random.seed` does.
    pub fn new(seed: u32) -> Self {
        let mut key = [0u32; N];
        key[0] = seed;
        for i in 1..N {
            let prev = key[i - 1];
            key[i] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(i as u32);
        }
        RandomState { key, pos: N }
    }

    /// Regenerate all `N` words at once.
    fn twist(&mut self) {
        for i in 0..N {
            let y = (self.key[i] & UPPER_MASK) | (self.key[(i + 1) % N] & LOWER_MASK);
            let mag = if y & 1 == 1 { MATRIX_A } else { 0 };
            self.key[i] = self.key[(i + M) % N] ^ (y >> 1) ^ mag;
        }
        self.pos = 0;
    }

    /// The next 32-bit output (`random_raw()` of NumPy's `MT19937`).
    pub fn next_u32(&mut self) -> u32 {
        if self.pos == N {
            self.twist();
        }
        let mut y = self.key[self.pos];
        self.pos += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// A 64-bit draw: two 32-bit outputs, the first one high.
    pub fn next_u64(&mut self) -> u64 {
        let high = u64::from(self.next_u32());
        (high << 32) | u64::from(self.next_u32())
    }

    /// A uniform integer in `[0, max]`: the smallest all-ones mask covering `max`, applied to 32-bit draws when
    /// `max` fits in 32 bits (else 64-bit draws), rejecting values above `max`.
    pub fn random_interval(&mut self, max: u64) -> u64 {
        if max == 0 {
            return 0;
        }
        let mask = u64::MAX >> max.leading_zeros();
        loop {
            let value = if max <= u64::from(u32::MAX) {
                u64::from(self.next_u32()) & mask
            } else {
                self.next_u64() & mask
            };
            if value <= max {
                return value;
            }
        }
    }

    /// `RandomState.shuffle`: Fisher-Yates from the last element down, swapping element `i` with one drawn
    /// from `[0, i]`.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.random_interval(i as u64) as usize;
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reference_seed_gives_the_reference_outputs() {
        // mt19937ar.c's default seed 5489: its first outputs, as published with the reference code.
        let mut rs = RandomState::new(5489);
        let first: Vec<u32> = (0..3).map(|_| rs.next_u32()).collect();
        assert_eq!(first, [3_499_211_612, 581_869_302, 3_890_346_734]);
        // ... and the 10000th output, the C++ standard's check value for std::mt19937.
        let mut rs = RandomState::new(5489);
        let nth = (0..10_000).map(|_| rs.next_u32()).last();
        assert_eq!(nth, Some(4_123_659_995));
    }

    #[test]
    fn intervals_stay_within_their_bound() {
        let mut rs = RandomState::new(42);
        for max in [1u64, 2, 3, 7, 8, 1000, u64::from(u32::MAX), 1 << 40] {
            for _ in 0..100 {
                assert!(rs.random_interval(max) <= max);
            }
        }
        assert_eq!(rs.random_interval(0), 0);
    }
}
