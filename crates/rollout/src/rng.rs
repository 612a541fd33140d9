//! Counter-based random numbers: a draw is a pure function of `(stream key, step)`.
//!
//! Why not a tch generator: libtorch draws for a whole tensor from one generator, so a row's
//! randomness would depend on its position in the batch and on which rows are still running.
//! Hashing `(key, step)` gives every sequence its own stream, independent of batch order,
//! composition, compaction and device.

/// SplitMix64's finaliser: a bijective avalanche mix of 64 bits.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// Derives a child key from a parent key and an index (seed -> prompt -> sample).
pub fn derive(parent: u64, index: u64) -> u64 {
    // Two rounds so that nearby (parent, index) pairs land far apart.
    mix(mix(parent ^ GOLDEN).wrapping_add(index.wrapping_add(1).wrapping_mul(GOLDEN)))
}

/// Uniform in `[0, 1)` with 53 random bits for stream `key` at decode step `step`.
pub fn uniform(key: u64, step: u64) -> f64 {
    let bits = derive(key, step);
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_in_range_and_roughly_uniform() {
        let n = 20_000;
        let mut sum = 0.0;
        let mut below_quarter = 0;
        for s in 0..n {
            let u = uniform(42, s);
            assert_eq!(u, uniform(42, s));
            assert!((0.0..1.0).contains(&u));
            sum += u;
            if u < 0.25 {
                below_quarter += 1;
            }
        }
        let mean = sum / n as f64;
        assert!((mean - 0.5).abs() < 0.01, "mean {mean}");
        let frac = below_quarter as f64 / n as f64;
        assert!((frac - 0.25).abs() < 0.015, "P(u < 0.25) = {frac}");
    }

    #[test]
    fn streams_differ() {
        assert_ne!(derive(1, 0), derive(1, 1));
        assert_ne!(derive(1, 0), derive(2, 0));
        assert_ne!(uniform(derive(7, 0), 0), uniform(derive(7, 1), 0));
        // Keys derived from adjacent indices give unrelated sequences.
        let a: Vec<f64> = (0..8).map(|s| uniform(derive(7, 0), s)).collect();
        let b: Vec<f64> = (0..8).map(|s| uniform(derive(7, 1), s)).collect();
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
    }
}
