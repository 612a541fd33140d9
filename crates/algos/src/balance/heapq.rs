//! A binary min-heap that moves items exactly as Python's `heapq.heappush` / `heapq.heappop` do.
//!
//! verl's Karmarkar–Karp keeps its states in a `heapq` list. Reproducing heapq's sift order (rather than
//! using any priority queue) keeps the pop order identical to verl's even where the ordering could not tell
//! two items apart, so partitions stay bit-identical whatever the input.

/// A `heapq`-style heap over a caller-given strict "less than" (Python's `__lt__`, the only comparison
/// heapq makes).
pub(super) struct HeapQ<T> {
    items: Vec<T>,
    less: fn(&T, &T) -> bool,
}

impl<T> HeapQ<T> {
    pub(super) fn new(less: fn(&T, &T) -> bool) -> Self {
        Self {
            items: Vec::new(),
            less,
        }
    }

    /// `heapq.heappush`: append, then bubble the new item toward the root (heapq's `_siftdown`).
    pub(super) fn push(&mut self, item: T) {
        self.items.push(item);
        let last = self.items.len() - 1;
        self.sift_toward_root(0, last);
    }

    /// `heapq.heappop`: the root leaves, the last item takes its place and sinks (heapq's `_siftup`).
    pub(super) fn pop(&mut self) -> Option<T> {
        let last = self.items.pop()?;
        if self.items.is_empty() {
            return Some(last);
        }
        let root = std::mem::replace(&mut self.items[0], last);
        self.sift_to_leaf_then_back(0);
        Some(root)
    }

    /// heapq's `_siftdown(heap, start, pos)`: the item at `pos` moves up while it is less than its parent.
    fn sift_toward_root(&mut self, start: usize, mut pos: usize) {
        while pos > start {
            let parent = (pos - 1) >> 1;
            if !(self.less)(&self.items[pos], &self.items[parent]) {
                break;
            }
            self.items.swap(pos, parent);
            pos = parent;
        }
    }

    /// heapq's `_siftup(heap, pos)`: the item at `pos` is pushed down to a leaf along the path of smaller
    /// children (children are compared with each other, never with the item; a tie goes to the right
    /// child), then bubbled back up from there.
    fn sift_to_leaf_then_back(&mut self, start: usize) {
        let end = self.items.len();
        let mut pos = start;
        let mut child = 2 * pos + 1;
        while child < end {
            let right = child + 1;
            if right < end && !(self.less)(&self.items[child], &self.items[right]) {
                child = right;
            }
            self.items.swap(pos, child);
            pos = child;
            child = 2 * pos + 1;
        }
        self.sift_toward_root(start, pos);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Items compared by key only, so equal keys are told apart by their tag: the order heapq leaves them in.
    fn by_key(a: &(u32, char), b: &(u32, char)) -> bool {
        a.0 < b.0
    }

    fn drain(mut heap: HeapQ<(u32, char)>) -> Vec<(u32, char)> {
        std::iter::from_fn(|| heap.pop()).collect()
    }

    #[test]
    fn pops_in_key_order() {
        let mut heap = HeapQ::new(by_key);
        for (i, key) in [5, 1, 4, 1, 5, 9, 2, 6].into_iter().enumerate() {
            heap.push((key, char::from(b'a' + i as u8)));
        }
        let keys: Vec<u32> = drain(heap).into_iter().map(|(k, _)| k).collect();
        assert_eq!(keys, vec![1, 1, 2, 4, 5, 5, 6, 9]);
    }

    #[test]
    fn equal_keys_leave_in_the_order_python_heapq_gives() {
        // Python 3.11, with `K.__lt__` comparing the key only:
        //   h = []; [heapq.heappush(h, K(k, t)) for k, t in [(1,'a'),(1,'b'),(0,'c'),(1,'d'),(1,'e'),(0,'f')]]
        //   ''.join(heapq.heappop(h).t for _ in range(6))  ->  'cfaebd'
        let mut heap = HeapQ::new(by_key);
        for item in [(1, 'a'), (1, 'b'), (0, 'c'), (1, 'd'), (1, 'e'), (0, 'f')] {
            heap.push(item);
        }
        let tags: String = drain(heap).into_iter().map(|(_, t)| t).collect();
        assert_eq!(tags, "cfaebd");
    }

    #[test]
    fn interleaved_pushes_and_pops_with_ties_match_python_heapq() {
        // Python 3.11: push keys[i] tagged 'a' + i, pop once after every third push, then drain.
        let keys = [1, 0, 1, 2, 0, 0, 2, 0, 1, 2, 0, 2, 0, 0, 0, 1, 1, 0, 0, 0];
        let mut heap = HeapQ::new(by_key);
        let mut popped = String::new();
        for (i, key) in keys.into_iter().enumerate() {
            heap.push((key, char::from(b'a' + i as u8)));
            if i % 3 == 2 {
                popped.extend(heap.pop().map(|(_, t)| t));
            }
        }
        popped.extend(drain(heap).into_iter().map(|(_, t)| t));
        assert_eq!(popped, "befhkmrstnoiqapcjdgl");
    }

    #[test]
    fn an_empty_heap_pops_nothing() {
        let mut heap = HeapQ::new(by_key);
        assert_eq!(heap.pop(), None);
        heap.push((3, 'x'));
        assert_eq!(heap.pop(), Some((3, 'x')));
        assert_eq!(heap.pop(), None);
    }
}
