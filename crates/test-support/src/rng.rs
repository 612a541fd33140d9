//! A seeded 64-bit LCG for test data: the same numbers on every machine and run, no RNG crate,
//! and no draw from libtorch's process-wide generator.

/// Knuth's MMIX LCG (`x ← 6364136223846793005·x + 1442695040888963407`). The state is public so
/// that a test can start from any seed: `Lcg(seed)`.
#[derive(Clone, Debug)]
pub struct Lcg(pub u64);

impl Lcg {
    /// Advances and returns the whole new state (the other draws are views of it).
    pub fn step(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0
    }

    /// The state's high 31 bits: an integer for `% n` draws (token ids, lengths).
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        self.step() >> 33
    }

    /// One of 10 000 evenly spaced values in `[0, 1)` (from [`next`](Self::next)).
    pub fn unit(&mut self) -> f32 {
        (self.next() % 10_000) as f32 / 10_000.0
    }

    /// A double in `[-1, 1)` from the state's high 53 bits.
    pub fn signed(&mut self) -> f64 {
        ((self.step() >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    }

    /// A float in `[0, 1)` from the state's high 24 bits.
    pub fn unit24(&mut self) -> f32 {
        (self.step() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// A float64 tensor of `shape` with values [`signed`](Self::signed)` × scale`, in order.
    #[cfg(feature = "torch")]
    pub fn tensor(&mut self, shape: &[i64], scale: f64) -> tch::Tensor {
        let n: i64 = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|_| self.signed() * scale).collect();
        tch::Tensor::from_slice(&v).reshape(shape)
    }
}
