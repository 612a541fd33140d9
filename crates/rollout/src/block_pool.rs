//! Host-side bookkeeping of the KV block pool: which blocks are free and how many block tables
//! reference each one. The tensors live in [`crate::paged_attn::KvPool`]; this only hands out ids.

use crate::error::{Result, RolloutError};

/// Block 0 is never handed out: padding positions of a forward write their keys/values there and
/// unused block-table entries point at it, so every gathered position is a finite value.
pub(crate) const TRASH_BLOCK: u32 = 0;

#[derive(Debug)]
pub(crate) struct BlockPool {
    refs: Vec<u32>,
    /// Free ids, popped from the end (lowest id first).
    free: Vec<u32>,
    peak_used: usize,
}

impl BlockPool {
    /// A pool of `total` blocks, `total - 1` of them usable.
    pub fn new(total: usize) -> BlockPool {
        BlockPool {
            refs: vec![0; total],
            free: (1..total as u32).rev().collect(),
            peak_used: 0,
        }
    }

    /// Blocks that can hold sequence data.
    pub fn usable(&self) -> usize {
        self.refs.len().saturating_sub(1)
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn used(&self) -> usize {
        self.usable() - self.free.len()
    }

    pub fn peak_used(&self) -> usize {
        self.peak_used
    }

    /// A fresh block with one reference.
    pub fn alloc(&mut self) -> Result<u32> {
        let b = self.free.pop().ok_or_else(|| {
            RolloutError::input(
                "KV block pool",
                "a free block (the scheduler reserves them before use)",
                format!("all {} blocks in use", self.usable()),
            )
        })?;
        self.refs[b as usize] = 1;
        self.peak_used = self.peak_used.max(self.used());
        Ok(b)
    }

    pub fn refcount(&self, b: u32) -> u32 {
        self.refs[b as usize]
    }

    /// One more block table points at `b`.
    pub fn share(&mut self, b: u32) {
        debug_assert!(self.refs[b as usize] > 0, "sharing free block {b}");
        self.refs[b as usize] += 1;
    }

    /// A block table lets go of `b`; the last one returns it to the free list.
    pub fn release(&mut self, b: u32) {
        let r = &mut self.refs[b as usize];
        debug_assert!(*r > 0, "releasing free block {b}");
        *r = r.saturating_sub(1);
        if *r == 0 {
            self.free.push(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_share_release_and_peak() {
        let mut p = BlockPool::new(4);
        assert_eq!((p.usable(), p.num_free(), p.used()), (3, 3, 0));
        let a = p.alloc().unwrap();
        let b = p.alloc().unwrap();
        assert_eq!((a, b), (1, 2));
        p.share(a);
        assert_eq!(p.refcount(a), 2);
        p.release(a);
        assert_eq!((p.refcount(a), p.num_free()), (1, 1));
        let c = p.alloc().unwrap();
        assert_eq!(c, 3);
        let e = p.alloc().unwrap_err().to_string();
        assert!(e.contains("all 3 blocks in use"), "{e}");
        p.release(a);
        p.release(b);
        assert_eq!((p.num_free(), p.used(), p.peak_used()), (2, 1, 3));
        // Freed blocks are reused; the trash block never is.
        let mut got = vec![p.alloc().unwrap(), p.alloc().unwrap()];
        got.sort();
        assert_eq!(got, [1, 2]);
        assert!(!got.contains(&TRASH_BLOCK));
    }
}
