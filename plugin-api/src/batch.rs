//! `Batch`: verl's DataProto as it crosses the ABI — named columns of tensors (host memory, row-major,
//! native byte order) or per-row strings / JSON texts, plus a JSON `meta` object.
//!
//! Every crossing checks the batch (always on, it is cheap next to a model call): equal leading dims,
//! byte counts that match shapes and dtypes, JSON rows that parse, and — against a contract's column
//! specs — dtypes, required columns and shared named dimensions (e.g. `response_length`).

use std::collections::BTreeMap;
use std::fmt;

use abi_stable::{
    std_types::{RString, RVec},
    StableAbi,
};

use crate::error::{Error, Result};

/// Element types of tensor columns; travels as a `u8` code so new types can be appended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F64,
    BF16,
    F16,
    I64,
    I32,
    U8,
    Bool,
}

impl DType {
    pub fn code(self) -> u8 {
        match self {
            DType::F32 => 1,
            DType::F64 => 2,
            DType::BF16 => 3,
            DType::F16 => 4,
            DType::I64 => 5,
            DType::I32 => 6,
            DType::U8 => 7,
            DType::Bool => 8,
        }
    }
    pub fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => DType::F32,
            2 => DType::F64,
            3 => DType::BF16,
            4 => DType::F16,
            5 => DType::I64,
            6 => DType::I32,
            7 => DType::U8,
            8 => DType::Bool,
            _ => return None,
        })
    }
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::U8 | DType::Bool => 1,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::U8 => "u8",
            DType::Bool => "bool",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Rust element types that map one-to-one onto a [`DType`].
pub trait Element: Copy + Send + Sync + 'static {
    const DTYPE: DType;
    fn write_ne(values: &[Self], out: &mut Vec<u8>);
    fn read_ne(bytes: &[u8]) -> Vec<Self>;
}

macro_rules! element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            fn write_ne(values: &[Self], out: &mut Vec<u8>) {
                out.reserve(values.len() * std::mem::size_of::<$t>());
                for v in values {
                    out.extend_from_slice(&v.to_ne_bytes());
                }
            }
            fn read_ne(bytes: &[u8]) -> Vec<Self> {
                bytes
                    .chunks_exact(std::mem::size_of::<$t>())
                    .map(|c| <$t>::from_ne_bytes(c.try_into().expect("chunk size")))
                    .collect()
            }
        }
    };
}
element!(f32, DType::F32);
element!(f64, DType::F64);
element!(i64, DType::I64);
element!(i32, DType::I32);
element!(u8, DType::U8);

impl Element for bool {
    const DTYPE: DType = DType::Bool;
    fn write_ne(values: &[Self], out: &mut Vec<u8>) {
        out.extend(values.iter().map(|&b| b as u8));
    }
    fn read_ne(bytes: &[u8]) -> Vec<Self> {
        bytes.iter().map(|&b| b != 0).collect()
    }
}

const KIND_TENSOR: u8 = 0;
const KIND_STRINGS: u8 = 1;
const KIND_JSON: u8 = 2;

/// One named column. ABI layout; use the accessor methods rather than the raw fields.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq)]
pub struct Column {
    pub name: RString,
    /// 0 = tensor, 1 = strings, 2 = JSON texts (one per row).
    pub kind: u8,
    /// [`DType::code`] for tensors, 0 otherwise.
    pub dtype: u8,
    /// Tensor shape; `[rows]` for string and JSON columns.
    pub shape: RVec<u64>,
    /// Tensor data: row-major, native byte order.
    pub bytes: RVec<u8>,
    /// String or JSON rows.
    pub strings: RVec<RString>,
}

/// What a column holds, as seen by Rust code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColumnType {
    Tensor(DType),
    Strings,
    Json,
}

impl fmt::Display for ColumnType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ColumnType::Tensor(d) => write!(f, "{d} tensor"),
            ColumnType::Strings => f.write_str("string"),
            ColumnType::Json => f.write_str("JSON"),
        }
    }
}

impl Column {
    pub fn name(&self) -> &str {
        self.name.as_str()
    }
    pub fn column_type(&self) -> Option<ColumnType> {
        match self.kind {
            KIND_TENSOR => DType::from_code(self.dtype).map(ColumnType::Tensor),
            KIND_STRINGS => Some(ColumnType::Strings),
            KIND_JSON => Some(ColumnType::Json),
            _ => None,
        }
    }
    pub fn shape(&self) -> &[u64] {
        self.shape.as_slice()
    }
    pub fn rows(&self) -> u64 {
        self.shape.first().copied().unwrap_or(0)
    }
}

/// verl's DataProto across the ABI.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq)]
pub struct Batch {
    pub columns: RVec<Column>,
    /// A JSON object (verl's `meta_info`); empty string means `{}`.
    pub meta: RString,
}

impl Default for Batch {
    fn default() -> Self {
        Self::new()
    }
}

impl Batch {
    pub fn new() -> Self {
        Batch {
            columns: RVec::new(),
            meta: RString::new(),
        }
    }

    /// Number of rows (leading dimension of the first column; 0 for an empty batch).
    pub fn rows(&self) -> usize {
        self.columns.first().map(|c| c.rows() as usize).unwrap_or(0)
    }

    pub fn column_names(&self) -> Vec<&str> {
        self.columns.iter().map(|c| c.name()).collect()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.column(name).is_some()
    }

    pub fn column(&self, name: &str) -> Option<&Column> {
        self.columns.iter().find(|c| c.name.as_str() == name)
    }

    fn put(&mut self, col: Column) {
        if let Some(slot) = self.columns.iter_mut().find(|c| c.name == col.name) {
            *slot = col;
        } else {
            self.columns.push(col);
        }
    }

    /// Insert (or replace) a tensor column. Panics if `data.len()` does not match `shape`: that is a
    /// bug in the caller's code, not bad input.
    pub fn insert_tensor<T: Element>(&mut self, name: &str, shape: &[usize], data: &[T]) {
        let numel: usize = shape.iter().product();
        assert_eq!(
            numel,
            data.len(),
            "Batch::insert_tensor(`{name}`): {} values for shape {shape:?}",
            data.len()
        );
        let mut bytes = Vec::with_capacity(numel * T::DTYPE.size());
        T::write_ne(data, &mut bytes);
        self.put(Column {
            name: name.into(),
            kind: KIND_TENSOR,
            dtype: T::DTYPE.code(),
            shape: shape.iter().map(|&d| d as u64).collect(),
            bytes: bytes.into(),
            strings: RVec::new(),
        });
    }

    /// Insert a tensor column from raw native-order bytes (e.g. bf16 data).
    pub fn insert_raw(&mut self, name: &str, dtype: DType, shape: &[usize], bytes: Vec<u8>) {
        let numel: usize = shape.iter().product();
        assert_eq!(
            numel * dtype.size(),
            bytes.len(),
            "Batch::insert_raw(`{name}`)"
        );
        self.put(Column {
            name: name.into(),
            kind: KIND_TENSOR,
            dtype: dtype.code(),
            shape: shape.iter().map(|&d| d as u64).collect(),
            bytes: bytes.into(),
            strings: RVec::new(),
        });
    }

    pub fn insert_strings<S: AsRef<str>>(&mut self, name: &str, rows: &[S]) {
        self.put(Column {
            name: name.into(),
            kind: KIND_STRINGS,
            dtype: 0,
            shape: vec![rows.len() as u64].into(),
            bytes: RVec::new(),
            strings: rows.iter().map(|s| RString::from(s.as_ref())).collect(),
        });
    }

    pub fn insert_json(&mut self, name: &str, rows: &[serde_json::Value]) {
        self.put(Column {
            name: name.into(),
            kind: KIND_JSON,
            dtype: 0,
            shape: vec![rows.len() as u64].into(),
            bytes: RVec::new(),
            strings: rows.iter().map(|v| RString::from(v.to_string())).collect(),
        });
    }

    pub fn remove(&mut self, name: &str) -> Option<Column> {
        let idx = self.columns.iter().position(|c| c.name.as_str() == name)?;
        Some(self.columns.remove(idx))
    }

    /// Rename a column in place (no copy).
    pub fn rename(&mut self, from: &str, to: &str) -> bool {
        self.remove(to);
        match self.columns.iter_mut().find(|c| c.name.as_str() == from) {
            Some(c) => {
                c.name = to.into();
                true
            }
            None => false,
        }
    }

    /// Move every column of `other` into `self` (replacing same-named ones).
    pub fn merge(&mut self, other: Batch) {
        for c in other.columns {
            self.put(c);
        }
    }

    /// The rows `rows` (in that order, repeats allowed) of every column. Panics on an index out of
    /// range: the caller's bug, not bad input.
    pub fn select_rows(&self, rows: &[usize]) -> Batch {
        let columns = self
            .columns
            .iter()
            .map(|c| {
                let mut shape: Vec<u64> = c.shape.iter().copied().collect();
                if let Some(first) = shape.first_mut() {
                    *first = rows.len() as u64;
                }
                let (bytes, strings) = if c.kind == KIND_TENSOR {
                    let n = c.rows().max(1) as usize;
                    let width = c.bytes.len() / n;
                    let mut out = Vec::with_capacity(width * rows.len());
                    for &r in rows {
                        out.extend_from_slice(&c.bytes[r * width..(r + 1) * width]);
                    }
                    (out.into(), RVec::new())
                } else {
                    (
                        RVec::new(),
                        rows.iter().map(|&r| c.strings[r].clone()).collect(),
                    )
                };
                Column {
                    name: c.name.clone(),
                    kind: c.kind,
                    dtype: c.dtype,
                    shape: shape.into(),
                    bytes,
                    strings,
                }
            })
            .collect();
        Batch {
            columns,
            meta: self.meta.clone(),
        }
    }

    /// The rows of `parts` one after the other. Every part must have the same columns with the
    /// same kinds, dtypes and trailing dimensions; the meta is the first part's.
    pub fn concat(parts: &[Batch]) -> Result<Batch> {
        let Some(first) = parts.first() else {
            return Ok(Batch::new());
        };
        let mut columns = Vec::with_capacity(first.columns.len());
        for c in first.columns.iter() {
            let mut rows = 0u64;
            let mut bytes = Vec::new();
            let mut strings = RVec::new();
            for (i, part) in parts.iter().enumerate() {
                let p = part.column(c.name()).ok_or_else(|| {
                    Error::invalid_input(format!(
                        "Batch::concat: part {i} has no column `{}`",
                        c.name()
                    ))
                })?;
                if p.kind != c.kind || p.dtype != c.dtype || p.shape.get(1..) != c.shape.get(1..) {
                    return Err(Error::invalid_input(format!(
                        "Batch::concat: column `{}` of part {i} has shape {:?}, part 0 {:?} (or another type)",
                        c.name(),
                        p.shape.as_slice(),
                        c.shape.as_slice()
                    )));
                }
                rows += p.rows();
                bytes.extend_from_slice(&p.bytes);
                strings.extend(p.strings.iter().cloned());
            }
            let mut shape: Vec<u64> = c.shape.iter().copied().collect();
            if let Some(first) = shape.first_mut() {
                *first = rows;
            }
            columns.push(Column {
                name: c.name.clone(),
                kind: c.kind,
                dtype: c.dtype,
                shape: shape.into(),
                bytes: bytes.into(),
                strings,
            });
        }
        Ok(Batch {
            columns: columns.into(),
            meta: first.meta.clone(),
        })
    }

    /// The batch as bytes (for moving it between processes, e.g. over the host's store), read
    /// back by [`Batch::from_bytes`] in a process of the same build and byte order.
    pub fn to_bytes(&self) -> Vec<u8> {
        fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
            out.extend_from_slice(&(b.len() as u64).to_le_bytes());
            out.extend_from_slice(b);
        }
        let mut out = Vec::new();
        out.extend_from_slice(&(self.columns.len() as u64).to_le_bytes());
        for c in self.columns.iter() {
            put_bytes(&mut out, c.name.as_bytes());
            out.push(c.kind);
            out.push(c.dtype);
            out.extend_from_slice(&(c.shape.len() as u64).to_le_bytes());
            for d in c.shape.iter() {
                out.extend_from_slice(&d.to_le_bytes());
            }
            put_bytes(&mut out, &c.bytes);
            out.extend_from_slice(&(c.strings.len() as u64).to_le_bytes());
            for s in c.strings.iter() {
                put_bytes(&mut out, s.as_bytes());
            }
        }
        put_bytes(&mut out, self.meta.as_bytes());
        out
    }

    /// Reads [`Batch::to_bytes`]'s output back, checked like any crossing.
    pub fn from_bytes(bytes: &[u8]) -> Result<Batch> {
        struct Reader<'a>(&'a [u8]);
        impl<'a> Reader<'a> {
            fn take(&mut self, n: usize) -> Result<&'a [u8]> {
                if self.0.len() < n {
                    return Err(Error::invalid_input(
                        "Batch::from_bytes: the bytes end early",
                    ));
                }
                let (head, rest) = self.0.split_at(n);
                self.0 = rest;
                Ok(head)
            }
            fn u64(&mut self) -> Result<u64> {
                Ok(u64::from_le_bytes(
                    self.take(8)?.try_into().expect("8 bytes"),
                ))
            }
            fn u8(&mut self) -> Result<u8> {
                Ok(self.take(1)?[0])
            }
            fn bytes(&mut self) -> Result<&'a [u8]> {
                let n = self.u64()? as usize;
                self.take(n)
            }
            fn text(&mut self) -> Result<RString> {
                let b = self.bytes()?;
                std::str::from_utf8(b)
                    .map(RString::from)
                    .map_err(|_| Error::invalid_input("Batch::from_bytes: a text is not UTF-8"))
            }
        }
        let mut r = Reader(bytes);
        let n = r.u64()? as usize;
        let mut columns = RVec::with_capacity(n.min(1 << 16));
        for _ in 0..n {
            let name = r.text()?;
            let kind = r.u8()?;
            let dtype = r.u8()?;
            let dims = r.u64()? as usize;
            let mut shape = RVec::new();
            for _ in 0..dims {
                shape.push(r.u64()?);
            }
            let data: RVec<u8> = r.bytes()?.to_vec().into();
            let count = r.u64()? as usize;
            let mut strings = RVec::new();
            for _ in 0..count {
                strings.push(r.text()?);
            }
            columns.push(Column {
                name,
                kind,
                dtype,
                shape,
                bytes: data,
                strings,
            });
        }
        let meta = r.text()?;
        let batch = Batch { columns, meta };
        batch.validate("Batch::from_bytes")?;
        Ok(batch)
    }

    fn missing(&self, call: &str, name: &str) -> Error {
        Error::MissingColumn {
            call: call.to_string(),
            column: name.to_string(),
            present: present_list(self),
        }
    }

    /// A tensor column's data and shape, checked for dtype.
    pub fn tensor<T: Element>(&self, name: &str) -> Result<Tensor<T>> {
        self.tensor_in("Batch::tensor", name)
    }

    /// Like [`Batch::tensor`], naming `call` in errors.
    pub fn tensor_in<T: Element>(&self, call: &str, name: &str) -> Result<Tensor<T>> {
        let col = self.column(name).ok_or_else(|| self.missing(call, name))?;
        match col.column_type() {
            Some(ColumnType::Tensor(d)) if d == T::DTYPE => {}
            Some(ColumnType::Tensor(d)) => {
                return Err(Error::DType {
                    call: call.into(),
                    column: name.into(),
                    expected: T::DTYPE.to_string(),
                    found: d.to_string(),
                })
            }
            other => {
                return Err(Error::ColumnKind {
                    call: call.into(),
                    column: name.into(),
                    expected: format!("{} tensor", T::DTYPE),
                    found: other.map_or("unknown".into(), |t| t.to_string()),
                })
            }
        }
        check_bytes(call, col)?;
        Ok(Tensor {
            shape: col.shape.iter().map(|&d| d as usize).collect(),
            data: T::read_ne(&col.bytes),
        })
    }

    /// The rows of a string column.
    pub fn strings(&self, name: &str) -> Result<Vec<String>> {
        let col = self
            .column(name)
            .ok_or_else(|| self.missing("Batch::strings", name))?;
        match col.column_type() {
            Some(ColumnType::Strings) | Some(ColumnType::Json) => {
                Ok(col.strings.iter().map(|s| s.to_string()).collect())
            }
            other => Err(Error::ColumnKind {
                call: "Batch::strings".into(),
                column: name.into(),
                expected: "string".into(),
                found: other.map_or("unknown".into(), |t| t.to_string()),
            }),
        }
    }

    /// The rows of a JSON column, parsed.
    pub fn json(&self, name: &str) -> Result<Vec<serde_json::Value>> {
        let col = self
            .column(name)
            .ok_or_else(|| self.missing("Batch::json", name))?;
        if col.column_type() != Some(ColumnType::Json) {
            return Err(Error::ColumnKind {
                call: "Batch::json".into(),
                column: name.into(),
                expected: "JSON".into(),
                found: col
                    .column_type()
                    .map_or("unknown".into(), |t| t.to_string()),
            });
        }
        col.strings
            .iter()
            .enumerate()
            .map(|(row, s)| {
                serde_json::from_str(s.as_str()).map_err(|e| Error::Json {
                    call: "Batch::json".into(),
                    column: name.into(),
                    row,
                    message: e.to_string(),
                })
            })
            .collect()
    }

    /// The `meta` object, parsed (`{}` when empty).
    pub fn meta(&self) -> serde_json::Map<String, serde_json::Value> {
        if self.meta.is_empty() {
            return serde_json::Map::new();
        }
        serde_json::from_str(self.meta.as_str()).unwrap_or_default()
    }

    pub fn set_meta(&mut self, meta: &serde_json::Map<String, serde_json::Value>) {
        self.meta = serde_json::Value::Object(meta.clone()).to_string().into();
    }

    /// Structural checks every batch must pass at every crossing: known column kinds and dtypes,
    /// unique names, byte counts matching shapes, string rows matching the shape, valid JSON rows,
    /// a JSON-object `meta`, and one leading dimension shared by all columns.
    pub fn validate(&self, call: &str) -> Result<()> {
        let mut seen = std::collections::BTreeSet::new();
        let mut rows: Option<(u64, &str)> = None;
        for col in self.columns.iter() {
            let name = col.name.as_str();
            if !seen.insert(name) {
                return Err(Error::DuplicateColumn {
                    call: call.into(),
                    column: name.into(),
                });
            }
            let ty = col.column_type().ok_or_else(|| Error::ColumnKind {
                call: call.into(),
                column: name.into(),
                expected: "tensor, string or JSON".into(),
                found: format!("kind code {} / dtype code {}", col.kind, col.dtype),
            })?;
            if col.shape.is_empty() {
                return Err(Error::Shape {
                    call: call.into(),
                    column: name.into(),
                    expected: "at least one dimension (rows)".into(),
                    found: vec![],
                    note: String::new(),
                });
            }
            match ty {
                ColumnType::Tensor(_) => check_bytes(call, col)?,
                ColumnType::Strings | ColumnType::Json => {
                    if col.shape.len() != 1 || col.shape[0] != col.strings.len() as u64 {
                        return Err(Error::Shape {
                            call: call.into(),
                            column: name.into(),
                            expected: format!("[{}] (one entry per string row)", col.strings.len()),
                            found: col.shape.to_vec(),
                            note: String::new(),
                        });
                    }
                    if ty == ColumnType::Json {
                        for (row, s) in col.strings.iter().enumerate() {
                            if let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(s) {
                                return Err(Error::Json {
                                    call: call.into(),
                                    column: name.into(),
                                    row,
                                    message: e.to_string(),
                                });
                            }
                        }
                    }
                }
            }
            match rows {
                None => rows = Some((col.shape[0], name)),
                Some((n, first)) if n != col.shape[0] => {
                    return Err(Error::Shape {
                        call: call.into(),
                        column: name.into(),
                        expected: format!("[{n}, ...]"),
                        found: col.shape.to_vec(),
                        note: format!(" (all columns share the row count; `{first}` has {n} rows)"),
                    })
                }
                _ => {}
            }
        }
        if !self.meta.is_empty() {
            match serde_json::from_str::<serde_json::Value>(&self.meta) {
                Ok(serde_json::Value::Object(_)) => {}
                _ => {
                    return Err(Error::Json {
                        call: call.into(),
                        column: "<meta>".into(),
                        row: 0,
                        message: "meta must be a JSON object".into(),
                    })
                }
            }
        }
        Ok(())
    }

    /// Check the batch against a contract: structural checks, then each spec's presence, type and
    /// dims. Named dims are bound by the first column that has them and must agree everywhere;
    /// `bindings` may pre-bind names (e.g. `rows`).
    pub fn check(
        &self,
        call: &str,
        specs: &[ColumnSpec],
        bindings: &[(&'static str, u64)],
    ) -> Result<()> {
        self.validate(call)?;
        let mut bound: BTreeMap<&str, (u64, String)> = bindings
            .iter()
            .map(|(k, v)| (*k, (*v, "the call".to_string())))
            .collect();
        for spec in specs {
            let Some(col) = self.column(spec.name) else {
                if spec.required {
                    return Err(self.missing(call, spec.name));
                }
                continue;
            };
            let ty = col.column_type().expect("validated");
            if ty != spec.ty {
                let (expected, found) = (spec.ty.to_string(), ty.to_string());
                return Err(match (spec.ty, ty) {
                    (ColumnType::Tensor(_), ColumnType::Tensor(_)) => Error::DType {
                        call: call.into(),
                        column: spec.name.into(),
                        expected: expected.replace(" tensor", ""),
                        found: found.replace(" tensor", ""),
                    },
                    _ => Error::ColumnKind {
                        call: call.into(),
                        column: spec.name.into(),
                        expected,
                        found,
                    },
                });
            }
            let shape = col.shape();
            let shape_err = |note: String, bound: &BTreeMap<&str, (u64, String)>| Error::Shape {
                call: call.into(),
                column: spec.name.into(),
                expected: describe_dims(spec.dims, bound),
                found: shape.to_vec(),
                note,
            };
            if shape.len() != spec.dims.len() {
                return Err(shape_err(
                    format!(" ({} dims, expected {})", shape.len(), spec.dims.len()),
                    &bound,
                ));
            }
            for (dim, &got) in spec.dims.iter().zip(shape) {
                match dim {
                    Dim::Any => {}
                    Dim::Fixed(n) if *n == got => {}
                    Dim::Fixed(_) => return Err(shape_err(String::new(), &bound)),
                    Dim::Named(name) => match bound.get(name) {
                        Some((n, _)) if *n == got => {}
                        Some((_, by)) => {
                            let note = format!(" (`{name}` was fixed by {by})");
                            return Err(shape_err(note, &bound));
                        }
                        None => {
                            bound.insert(name, (got, format!("column `{}`", spec.name)));
                        }
                    },
                }
            }
        }
        Ok(())
    }
}

fn present_list(b: &Batch) -> String {
    let names = b.column_names();
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

fn describe_dims(dims: &[Dim], bound: &BTreeMap<&str, (u64, String)>) -> String {
    let parts: Vec<String> = dims
        .iter()
        .map(|d| match d {
            Dim::Any => "_".to_string(),
            Dim::Fixed(n) => n.to_string(),
            Dim::Named(name) => match bound.get(name) {
                Some((n, _)) => format!("{name}={n}"),
                None => name.to_string(),
            },
        })
        .collect();
    format!("[{}]", parts.join(", "))
}

fn check_bytes(call: &str, col: &Column) -> Result<()> {
    let dtype = DType::from_code(col.dtype).expect("tensor column with valid dtype");
    let numel: u64 = col.shape.iter().product();
    let expected = numel * dtype.size() as u64;
    if expected != col.bytes.len() as u64 {
        return Err(Error::Corrupt {
            call: call.into(),
            column: col.name.to_string(),
            shape: col.shape.to_vec(),
            dtype: dtype.to_string(),
            expected,
            found: col.bytes.len() as u64,
        });
    }
    Ok(())
}

/// A tensor column copied out of a batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor<T> {
    pub shape: Vec<usize>,
    pub data: Vec<T>,
}

impl<T: Copy> Tensor<T> {
    /// Row `i` of a 2-D tensor.
    pub fn row(&self, i: usize) -> &[T] {
        let w = self.shape.get(1).copied().unwrap_or(1);
        &self.data[i * w..(i + 1) * w]
    }
    pub fn rows(&self) -> usize {
        self.shape.first().copied().unwrap_or(0)
    }
    pub fn cols(&self) -> usize {
        self.shape.get(1).copied().unwrap_or(1)
    }
}

/// A dimension in a column spec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dim {
    /// Must equal the dimension of the same name in every other column of the batch.
    Named(&'static str),
    Fixed(u64),
    Any,
}

/// What a contract expects of one column.
#[derive(Debug, Clone, Copy)]
pub struct ColumnSpec {
    pub name: &'static str,
    pub ty: ColumnType,
    pub dims: &'static [Dim],
    pub required: bool,
}

impl ColumnSpec {
    pub const fn tensor(name: &'static str, dtype: DType, dims: &'static [Dim]) -> Self {
        ColumnSpec {
            name,
            ty: ColumnType::Tensor(dtype),
            dims,
            required: true,
        }
    }
    pub const fn strings(name: &'static str) -> Self {
        ColumnSpec {
            name,
            ty: ColumnType::Strings,
            dims: &[ROWS],
            required: true,
        }
    }
    pub const fn json(name: &'static str) -> Self {
        ColumnSpec {
            name,
            ty: ColumnType::Json,
            dims: &[ROWS],
            required: true,
        }
    }
    pub const fn optional(mut self) -> Self {
        self.required = false;
        self
    }
}

/// The shared row dimension.
pub const ROWS: Dim = Dim::Named("rows");

#[cfg(test)]
mod tests;
