//! [`Groups`]: which rows are samples of the same prompt (verl's `uid` / `index` array).

use std::collections::HashMap;
use std::hash::Hash;

/// A per-row group assignment, densified to `0..num_groups` in order of first appearance.
///
/// verl groups rows by the `uid` string it attaches to each prompt before repeating it `n` times; the
/// golden data uses small integers. Any hashable key works: [`Groups::from_keys`] accepts `&[String]`,
/// `&[&str]`, `&[u64]`, …
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Groups {
    group_of_row: Vec<usize>,
    members: Vec<Vec<usize>>,
}

impl Groups {
    /// Groups rows by key; row `i` belongs to the group of `keys[i]`.
    pub fn from_keys<K: Hash + Eq>(keys: &[K]) -> Self {
        let mut dense: HashMap<&K, usize> = HashMap::with_capacity(keys.len());
        let mut members: Vec<Vec<usize>> = Vec::new();
        let group_of_row = keys
            .iter()
            .enumerate()
            .map(|(row, key)| {
                let g = *dense.entry(key).or_insert_with(|| {
                    members.push(Vec::new());
                    members.len() - 1
                });
                members[g].push(row);
                g
            })
            .collect();
        Self {
            group_of_row,
            members,
        }
    }

    /// Number of rows covered (must equal the batch size of the inputs it is used with).
    pub fn num_rows(&self) -> usize {
        self.group_of_row.len()
    }

    /// Number of distinct groups.
    pub fn num_groups(&self) -> usize {
        self.members.len()
    }

    /// The dense group id of `row`.
    pub fn group_of(&self, row: usize) -> usize {
        self.group_of_row[row]
    }

    /// The rows of group `g`, in row order.
    pub fn members(&self, g: usize) -> &[usize] {
        &self.members[g]
    }

    /// Iterates over groups as row lists, in order of first appearance.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &[usize]> + '_ {
        self.members.iter().map(Vec::as_slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn string_uids_are_densified_in_order_of_first_appearance() {
        let g = Groups::from_keys(&["b", "a", "b", "c", "a"]);
        assert_eq!(g.num_rows(), 5);
        assert_eq!(g.num_groups(), 3);
        assert_eq!(
            (0..5).map(|r| g.group_of(r)).collect::<Vec<_>>(),
            vec![0, 1, 0, 2, 1]
        );
        assert_eq!(g.members(0), &[0, 2]);
        assert_eq!(
            g.iter().map(<[usize]>::len).collect::<Vec<_>>(),
            vec![2, 2, 1]
        );
    }

    #[test]
    fn integer_uids_work_too_and_non_contiguous_groups_stay_grouped() {
        let g = Groups::from_keys(&[7u64, 9, 7, 9]);
        assert_eq!(g.members(0), &[0, 2]);
        assert_eq!(g.members(1), &[1, 3]);
    }
}
