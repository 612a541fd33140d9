//! The crate's single error type.

/// Everything that can go wrong in `verl-algos`.
///
/// Variants name the operation (`op`, usually the verl function being mirrored), the input or config key
/// involved, what was expected and what was found, so a failure deep in the host loop reads on its own.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
// The fields are the structured parts of each variant's message, which documents them.
#[allow(missing_docs)]
pub enum AlgoError {
    // ---- shapes -------------------------------------------------------------------------------------
    /// A per-token input does not have the shape of the reference input of the same call.
    #[error(
        "{op}: `{input}` has shape [{}, {}], expected [{}, {}] (the shape of `{reference}`)",
        found.0, found.1, expected.0, expected.1
    )]
    ShapeMismatch {
        op: &'static str,
        input: &'static str,
        reference: &'static str,
        expected: (usize, usize),
        found: (usize, usize),
    },

    /// A per-row input (group ids, reward baselines) does not have one entry per batch row.
    #[error(
        "{op}: `{input}` has {found} entries, expected {expected} (one per row of `{reference}`)"
    )]
    LengthMismatch {
        op: &'static str,
        input: &'static str,
        reference: &'static str,
        expected: usize,
        found: usize,
    },

    /// A flat buffer handed to [`crate::Grid`] does not hold `rows × cols` elements.
    #[error("Grid: buffer has {found} elements, expected rows × cols = {rows} × {cols} = {}", rows * cols)]
    BufferSize {
        rows: usize,
        cols: usize,
        found: usize,
    },

    /// Nested rows handed to [`crate::Grid`] are not all the same length.
    #[error("Grid: row {row} has {found} columns, expected {expected} (the length of row 0)")]
    RaggedRows {
        row: usize,
        expected: usize,
        found: usize,
    },

    // ---- inputs the chosen algorithm needs ----------------------------------------------------------
    /// The chosen estimator needs an input the caller did not provide.
    #[error("advantage estimator `{estimator}` needs `{input}`, which was not provided ({why})")]
    MissingInput {
        estimator: &'static str,
        input: &'static str,
        why: &'static str,
    },

    // ---- statistics ---------------------------------------------------------------------------------
    /// An unbiased masked variance over a mask that selects nothing (verl raises here too).
    #[error(
        "{op}: the mask selects no element (mask sum is 0); an unbiased variance needs at least 2"
    )]
    EmptyMask { op: &'static str },

    /// An unbiased masked variance over a mask that selects exactly one element (division by zero in verl).
    #[error("{op}: the mask selects exactly one element; an unbiased variance needs at least 2 (use a larger batch)")]
    SingleElementMask { op: &'static str },

    // ---- configuration ------------------------------------------------------------------------------
    /// A name (estimator, KL penalty, controller type) that verl does not know either.
    #[error("`{key}`: unknown value `{found}`, expected one of: {}", expected.join(", "))]
    UnknownName {
        key: &'static str,
        found: String,
        expected: &'static [&'static str],
    },

    /// A name verl knows that verl-rs deliberately does not implement.
    #[error("`{key}`: `{found}` is not supported: {reason}")]
    Unsupported {
        key: &'static str,
        found: String,
        reason: &'static str,
    },

    /// A numeric setting out of its valid range.
    #[error("`{key}`: got {found}, expected {expected}")]
    InvalidParam {
        key: &'static str,
        found: String,
        expected: &'static str,
    },

    // ---- partitioning (sequence-length balancing) ---------------------------------------------------
    /// Too few items (values, rows, uid groups) for the requested number of partitions.
    #[error("{op}: {found} {what} for {k} partitions, expected at least {needed}")]
    TooFewItems {
        op: &'static str,
        what: &'static str,
        found: usize,
        needed: usize,
        k: usize,
    },

    /// Equal-size partitioning asked of a count the number of partitions does not divide.
    #[error("{op}: {found} {what} do not split into {k} partitions of equal size ({hint})")]
    NotDivisible {
        op: &'static str,
        what: &'static str,
        found: usize,
        k: usize,
        hint: &'static str,
    },

    /// The partitioning left a partition with no item (only negative values can cause this).
    #[error("{op}: partition {index} of {k} is empty (are some values negative?)")]
    EmptyPartition {
        op: &'static str,
        index: usize,
        k: usize,
    },

    /// A partition names an item the input does not have.
    #[error("{op}: `{input}` names index {index}, but there are only {len} items")]
    IndexOutOfRange {
        op: &'static str,
        input: &'static str,
        index: usize,
        len: usize,
    },

    /// An integer sum that verl computes exactly (Python ints) does not fit the `i64` it is kept in.
    #[error("{op}: {what} overflows i64")]
    Overflow { op: &'static str, what: String },

    // ---- multi-rank ---------------------------------------------------------------------------------
    /// The caller's cross-rank reduction failed or returned the wrong number of values.
    #[error("{op}: cross-rank reduction failed: {message}")]
    Collective { op: &'static str, message: String },
}

/// Shorthand used throughout the crate.
pub type Result<T, E = AlgoError> = std::result::Result<T, E>;
