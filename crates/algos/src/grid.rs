//! [`Grid`]: the row-major `[batch × response_len]` container every algorithm here works on.

use std::ops::{Index, IndexMut};

use crate::error::{AlgoError, Result};

/// A dense row-major 2-D array: row `r` is one response, column `c` one response token.
///
/// Algorithms compute in `f64` (the golden references are float64); tensors crossing the plugin ABI are
/// `f32`, hence [`Grid::from_f32`] / [`Grid::to_f32`].
#[derive(Debug, Clone, PartialEq)]
pub struct Grid<T> {
    rows: usize,
    cols: usize,
    data: Vec<T>,
}

impl<T> Grid<T> {
    /// Wraps a row-major buffer; fails unless `data.len() == rows * cols`.
    pub fn new(rows: usize, cols: usize, data: Vec<T>) -> Result<Self> {
        if data.len() != rows * cols {
            return Err(AlgoError::BufferSize {
                rows,
                cols,
                found: data.len(),
            });
        }
        Ok(Self { rows, cols, data })
    }

    /// Number of rows (batch size).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of columns (response length).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// The whole buffer, row-major.
    pub fn as_slice(&self) -> &[T] {
        &self.data
    }

    /// The whole buffer, row-major, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        &mut self.data
    }

    /// Gives the buffer back, row-major.
    pub fn into_vec(self) -> Vec<T> {
        self.data
    }

    /// Row `r`. Panics when `r >= rows` (an indexing bug, not a data error).
    pub fn row(&self, r: usize) -> &[T] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// Row `r`, mutably. Panics when `r >= rows`.
    pub fn row_mut(&mut self, r: usize) -> &mut [T] {
        &mut self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// Iterates over the rows.
    pub fn iter_rows(&self) -> impl ExactSizeIterator<Item = &[T]> + '_ {
        // `chunks_exact(0)` panics; a zero-width grid still has `rows` (empty) rows.
        (0..self.rows).map(move |r| self.row(r))
    }

    /// Applies `f` elementwise.
    pub fn map<U>(&self, f: impl FnMut(&T) -> U) -> Grid<U> {
        Grid {
            rows: self.rows,
            cols: self.cols,
            data: self.data.iter().map(f).collect(),
        }
    }

    /// Fails with [`AlgoError::ShapeMismatch`] unless `other` has this grid's shape.
    ///
    /// `op` is the calling function, `input` the name of `other`, `reference` the name of `self`.
    pub fn check_same_shape<U>(
        &self,
        other: &Grid<U>,
        op: &'static str,
        reference: &'static str,
        input: &'static str,
    ) -> Result<()> {
        if self.shape() != other.shape() {
            return Err(AlgoError::ShapeMismatch {
                op,
                input,
                reference,
                expected: self.shape(),
                found: other.shape(),
            });
        }
        Ok(())
    }
}

impl<T: Clone> Grid<T> {
    /// A grid with every element equal to `value`.
    pub fn filled(rows: usize, cols: usize, value: T) -> Self {
        Self {
            rows,
            cols,
            data: vec![value; rows * cols],
        }
    }

    /// Builds a grid from nested rows; fails on ragged rows. An empty slice gives a `0 × 0` grid.
    pub fn from_rows<R: AsRef<[T]>>(rows: &[R]) -> Result<Self> {
        let cols = rows.first().map_or(0, |r| r.as_ref().len());
        let mut data = Vec::with_capacity(rows.len() * cols);
        for (i, r) in rows.iter().enumerate() {
            let r = r.as_ref();
            if r.len() != cols {
                return Err(AlgoError::RaggedRows {
                    row: i,
                    expected: cols,
                    found: r.len(),
                });
            }
            data.extend_from_slice(r);
        }
        Ok(Self {
            rows: rows.len(),
            cols,
            data,
        })
    }

    /// The rows as nested vectors (for JSON, tests and debugging).
    pub fn to_rows(&self) -> Vec<Vec<T>> {
        self.iter_rows().map(<[T]>::to_vec).collect()
    }
}

impl Grid<f64> {
    /// Widens an `f32` buffer (as it crosses the plugin ABI) to the `f64` the algorithms compute in.
    pub fn from_f32(rows: usize, cols: usize, data: &[f32]) -> Result<Self> {
        Self::new(rows, cols, data.iter().map(|&x| f64::from(x)).collect())
    }

    /// Narrows to the `f32` row-major buffer the plugin ABI carries.
    pub fn to_f32(&self) -> Vec<f32> {
        // Rounding to nearest is the point: results go back to f32 tensors.
        #[allow(clippy::cast_possible_truncation)]
        self.data.iter().map(|&x| x as f32).collect()
    }
}

impl From<&Grid<f32>> for Grid<f64> {
    fn from(g: &Grid<f32>) -> Self {
        g.map(|&x| f64::from(x))
    }
}

impl<T> Index<(usize, usize)> for Grid<T> {
    type Output = T;
    fn index(&self, (r, c): (usize, usize)) -> &T {
        // Without this, an out-of-range column would silently read the next row.
        assert!(
            c < self.cols,
            "Grid column {c} out of range (cols = {})",
            self.cols
        );
        &self.data[r * self.cols + c]
    }
}

impl<T> IndexMut<(usize, usize)> for Grid<T> {
    fn index_mut(&mut self, (r, c): (usize, usize)) -> &mut T {
        assert!(
            c < self.cols,
            "Grid column {c} out of range (cols = {})",
            self.cols
        );
        &mut self.data[r * self.cols + c]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_rejects_a_buffer_of_the_wrong_size() {
        let err = Grid::new(2, 3, vec![0.0; 5]).unwrap_err();
        assert_eq!(
            err,
            AlgoError::BufferSize {
                rows: 2,
                cols: 3,
                found: 5
            }
        );
        assert!(err.to_string().contains("2 × 3 = 6"), "{err}");
    }

    #[test]
    fn from_rows_names_the_ragged_row() {
        let err = Grid::from_rows(&[vec![1.0, 2.0], vec![3.0, 4.0], vec![5.0]]).unwrap_err();
        assert_eq!(
            err,
            AlgoError::RaggedRows {
                row: 2,
                expected: 2,
                found: 1
            }
        );
    }

    #[test]
    fn rows_are_row_major_and_round_trip() {
        let g = Grid::from_rows(&[[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]).unwrap();
        assert_eq!(g.shape(), (2, 3));
        assert_eq!(g.row(1), &[4.0, 5.0, 6.0]);
        assert_eq!(g[(0, 2)], 3.0);
        assert_eq!(g.as_slice(), &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(g.to_rows(), vec![vec![1.0, 2.0, 3.0], vec![4.0, 5.0, 6.0]]);
    }

    #[test]
    fn f32_conversion_round_trips_exactly_representable_values() {
        let g = Grid::from_f32(1, 3, &[0.5, -1.25, 3.0]).unwrap();
        assert_eq!(g.as_slice(), &[0.5, -1.25, 3.0]);
        assert_eq!(g.to_f32(), vec![0.5f32, -1.25, 3.0]);
        let g32 = Grid::new(1, 2, vec![1.5f32, 2.0]).unwrap();
        assert_eq!(Grid::<f64>::from(&g32).as_slice(), &[1.5, 2.0]);
    }

    #[test]
    #[should_panic(expected = "column 3 out of range")]
    fn indexing_past_the_last_column_panics_instead_of_reading_the_next_row() {
        let g = Grid::filled(2, 3, 0u8);
        let _ = g[(0, 3)];
    }

    #[test]
    fn zero_width_grid_still_has_its_rows() {
        let g = Grid::<f64>::filled(3, 0, 0.0);
        assert_eq!(g.iter_rows().count(), 3);
        assert!(g.row(2).is_empty());
    }

    #[test]
    fn shape_check_names_both_inputs() {
        let a = Grid::filled(2, 3, 0.0);
        let b = Grid::filled(2, 4, 0.0);
        let msg = a
            .check_same_shape(&b, "op_x", "token_level_rewards", "response_mask")
            .unwrap_err()
            .to_string();
        assert_eq!(
            msg,
            "op_x: `response_mask` has shape [2, 4], expected [2, 3] (the shape of `token_level_rewards`)"
        );
    }
}
