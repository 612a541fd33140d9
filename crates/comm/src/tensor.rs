//! Tensor plumbing shared by the backends: staging into contiguous buffers on the backend's device
//! and raw byte views of them.

use tch::{Device, Kind, Tensor};

use crate::error::torch;
use crate::CommError;

/// A contiguous tensor on the backend's device holding (or receiving) a caller's tensor's data.
/// When the caller's tensor already qualifies it is used directly (a shallow clone shares its
/// storage); otherwise a copy is made and [`Staged::finish`] writes results back.
pub(crate) struct Staged {
    pub t: Tensor,
    copied: bool,
}

impl Staged {
    pub fn new(src: &Tensor, device: Device, op: &'static str) -> Result<Staged, CommError> {
        if src.device() == device && src.is_contiguous() {
            return Ok(Staged {
                t: src.shallow_clone(),
                copied: false,
            });
        }
        let t = src
            .f_to_device(device)
            .and_then(|t| t.f_contiguous())
            .map_err(torch(op))?;
        Ok(Staged { t, copied: true })
    }

    /// Whether staging made a copy (results must be written back with [`Staged::finish`]).
    pub fn copied(&self) -> bool {
        self.copied
    }

    /// Copies the staged data back into `dst` if staging made a copy.
    pub fn finish(self, dst: &mut Tensor, op: &'static str) -> Result<(), CommError> {
        if self.copied {
            dst.f_copy_(&self.t).map_err(torch(op))?;
        }
        Ok(())
    }
}

pub(crate) fn nbytes(t: &Tensor) -> usize {
    t.numel() * t.kind().elt_size_in_bytes()
}

/// The bytes of a contiguous CPU tensor.
///
/// Safety: `t` must be contiguous and on the CPU, and its storage must not be written through
/// another handle while the slice lives.
pub(crate) unsafe fn bytes(t: &Tensor) -> &[u8] {
    let n = nbytes(t);
    if n == 0 {
        return &[];
    }
    std::slice::from_raw_parts(t.data_ptr() as *const u8, n)
}

/// The bytes of a contiguous CPU tensor, writable.
///
/// Safety: as [`bytes`], and no other slice of the same storage may live at the same time.
pub(crate) unsafe fn bytes_mut(t: &mut Tensor) -> &mut [u8] {
    let n = nbytes(t);
    if n == 0 {
        return &mut [];
    }
    std::slice::from_raw_parts_mut(t.data_ptr() as *mut u8, n)
}

/// Wire code of a dtype: peers check it so that a mismatch is an error, not garbage.
pub(crate) fn kind_code(kind: Kind) -> Option<u8> {
    Some(match kind {
        Kind::Float => 1,
        Kind::Double => 2,
        Kind::Half => 3,
        Kind::BFloat16 => 4,
        Kind::Int64 => 5,
        Kind::Int => 6,
        Kind::Int16 => 7,
        Kind::Int8 => 8,
        Kind::Uint8 => 9,
        Kind::Bool => 10,
        _ => return None,
    })
}

pub(crate) fn kind_name(code: u8) -> String {
    let kind = [
        (1, Kind::Float),
        (2, Kind::Double),
        (3, Kind::Half),
        (4, Kind::BFloat16),
        (5, Kind::Int64),
        (6, Kind::Int),
        (7, Kind::Int16),
        (8, Kind::Int8),
        (9, Kind::Uint8),
        (10, Kind::Bool),
    ]
    .iter()
    .find(|(c, _)| *c == code)
    .map(|(_, k)| *k);
    match kind {
        Some(k) => format!("{k:?}"),
        None => format!("dtype code {code}"),
    }
}

pub(crate) fn is_integral(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::Int64 | Kind::Int | Kind::Int16 | Kind::Int8 | Kind::Uint8
    )
}

/// Splits `n` elements into `parts` contiguous ranges whose sizes differ by at most one.
pub(crate) fn partition(n: usize, parts: usize) -> Vec<std::ops::Range<usize>> {
    let (base, extra) = (n / parts, n % parts);
    let mut start = 0;
    (0..parts)
        .map(|i| {
            let len = base + usize::from(i < extra);
            let r = start..start + len;
            start += len;
            r
        })
        .collect()
}

/// Disjoint mutable views of `data` at the given element ranges (sorted, non-overlapping).
pub(crate) fn split_mut<'a>(
    mut data: &'a mut [u8],
    ranges: &[std::ops::Range<usize>],
    elt: usize,
) -> Vec<&'a mut [u8]> {
    let mut out = Vec::with_capacity(ranges.len());
    let mut consumed = 0;
    for r in ranges {
        let (_, rest) = std::mem::take(&mut data).split_at_mut((r.start - consumed) * elt);
        let (chunk, rest) = rest.split_at_mut(r.len() * elt);
        out.push(chunk);
        data = rest;
        consumed = r.end;
    }
    out
}

pub(crate) fn check_same_kind(
    op: &'static str,
    what: &str,
    expected: Kind,
    found: Kind,
) -> Result<(), CommError> {
    if expected != found {
        return Err(CommError::Shape {
            op,
            what: format!("dtype of {what}"),
            expected: format!("{expected:?}"),
            found: format!("{found:?}"),
        });
    }
    Ok(())
}
