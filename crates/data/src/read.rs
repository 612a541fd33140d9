//! File formats → rows as JSON objects. All tabular formats go through Arrow record batches,
//! so parquet and Arrow IPC share one conversion and one set of type rules.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float16Type, Float32Type, Float64Type, Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type,
    UInt32Type, UInt64Type, UInt8Type,
};
use arrow_array::{Array, RecordBatch};
use arrow_cast::display::{ArrayFormatter, FormatOptions};
use arrow_schema::{ArrowError, DataType, Fields};
use serde_json::{Map, Value};

use crate::error::{DataError, Result};

pub type Row = Map<String, Value>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Parquet,
    /// Arrow IPC file format (`.arrow`, `.feather` v2, `.ipc`); the stream format is accepted too.
    ArrowIpc,
    /// One JSON object per line; a `.json` file holding one top-level array is accepted as well.
    Jsonl,
}

impl Format {
    pub fn of(path: &Path) -> Result<Self> {
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase)
            .unwrap_or_default();
        match ext.as_str() {
            "parquet" | "pq" => Ok(Format::Parquet),
            "arrow" | "feather" | "ipc" | "arrows" => Ok(Format::ArrowIpc),
            "jsonl" | "json" | "ndjson" => Ok(Format::Jsonl),
            _ => Err(DataError::UnknownExtension {
                path: path.to_path_buf(),
                extension: if ext.is_empty() {
                    "(none)".into()
                } else {
                    format!(".{ext}")
                },
            }),
        }
    }
}

/// The rows of one file plus, for tabular formats, the column names of its schema.
pub struct Table {
    pub columns: Option<Vec<String>>,
    pub rows: Vec<Row>,
}

pub fn read_table(path: &Path) -> Result<Table> {
    let format = Format::of(path)?;
    let io = |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    match format {
        Format::Parquet => read_parquet(path, file),
        Format::ArrowIpc => read_ipc(path, file),
        Format::Jsonl => read_jsonl(path, file),
    }
}

fn read_parquet(path: &Path, file: File) -> Result<Table> {
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    let pq = |source| DataError::Parquet {
        path: path.to_path_buf(),
        source,
    };
    let builder = ParquetRecordBatchReaderBuilder::try_new(file).map_err(pq)?;
    let columns = field_names(builder.schema().fields());
    let reader = builder.build().map_err(pq)?;
    let mut rows = Vec::new();
    for batch in reader {
        let batch = batch.map_err(|source| arrow_err(path, source))?;
        rows.extend(batch_to_rows(&batch).map_err(|source| arrow_err(path, source))?);
    }
    Ok(Table {
        columns: Some(columns),
        rows,
    })
}

fn read_ipc(path: &Path, file: File) -> Result<Table> {
    use arrow_ipc::reader::{FileReader, StreamReader};
    // Files named .arrow are sometimes written in the stream format; try the file format
    // first and fall back to the stream format so both load.
    let (columns, batches): (
        Vec<String>,
        Vec<std::result::Result<RecordBatch, ArrowError>>,
    ) = match FileReader::try_new(BufReader::new(file), None) {
        Ok(reader) => (field_names(reader.schema().fields()), reader.collect()),
        Err(file_err) => {
            let reopened = File::open(path).map_err(|source| DataError::Io {
                path: path.to_path_buf(),
                source,
            })?;
            match StreamReader::try_new(BufReader::new(reopened), None) {
                Ok(reader) => (field_names(reader.schema().fields()), reader.collect()),
                // The file-format error is the one that explains a non-Arrow file.
                Err(_) => return Err(arrow_err(path, file_err)),
            }
        }
    };
    let mut rows = Vec::new();
    for batch in batches {
        let batch = batch.map_err(|source| arrow_err(path, source))?;
        rows.extend(batch_to_rows(&batch).map_err(|source| arrow_err(path, source))?);
    }
    Ok(Table {
        columns: Some(columns),
        rows,
    })
}

fn read_jsonl(path: &Path, file: File) -> Result<Table> {
    let io = |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut reader = BufReader::new(file);
    // A `.json` file may be one array of rows (pandas `to_json(orient="records")`).
    let first = {
        let buf = reader.fill_buf().map_err(io)?;
        buf.iter().copied().find(|b| !b.is_ascii_whitespace())
    };
    let mut rows = Vec::new();
    if first == Some(b'[') {
        let mut text = String::new();
        reader.read_to_string(&mut text).map_err(io)?;
        let value: Value = serde_json::from_str(&text).map_err(|source| DataError::Json {
            path: path.to_path_buf(),
            line: 1,
            source,
        })?;
        let Value::Array(items) = value else {
            unreachable!("text starts with '['")
        };
        for (i, item) in items.into_iter().enumerate() {
            rows.push(expect_object(path, i + 1, item)?);
        }
    } else {
        for (i, line) in reader.lines().enumerate() {
            let line = line.map_err(io)?;
            if line.trim().is_empty() {
                continue;
            }
            let value: Value = serde_json::from_str(&line).map_err(|source| DataError::Json {
                path: path.to_path_buf(),
                line: i + 1,
                source,
            })?;
            rows.push(expect_object(path, i + 1, value)?);
        }
    }
    Ok(Table {
        columns: None,
        rows,
    })
}

fn expect_object(path: &Path, line: usize, value: Value) -> Result<Row> {
    match value {
        Value::Object(map) => Ok(map),
        other => Err(DataError::JsonNotObject {
            path: path.to_path_buf(),
            line,
            found: crate::sample::describe(&other),
        }),
    }
}

fn arrow_err(path: &Path, source: ArrowError) -> DataError {
    DataError::Arrow {
        path: PathBuf::from(path),
        source,
    }
}

fn field_names(fields: &Fields) -> Vec<String> {
    fields.iter().map(|f| f.name().clone()).collect()
}

/// Converts a record batch into one JSON object per row, columns in schema order.
pub fn batch_to_rows(batch: &RecordBatch) -> std::result::Result<Vec<Row>, ArrowError> {
    let schema = batch.schema();
    let mut columns: Vec<Vec<Value>> = batch
        .columns()
        .iter()
        .map(|c| array_to_json(c.as_ref()))
        .collect::<std::result::Result<_, _>>()?;
    let mut rows = Vec::with_capacity(batch.num_rows());
    for i in 0..batch.num_rows() {
        let mut row = Map::new();
        for (field, column) in schema.fields().iter().zip(columns.iter_mut()) {
            row.insert(field.name().clone(), std::mem::take(&mut column[i]));
        }
        rows.push(row);
    }
    Ok(rows)
}

/// Converts a whole Arrow array to JSON values, column-wise (children are converted once and
/// then sliced by offsets, which keeps nested `list<struct>` prompts cheap).
/// Types without a natural JSON form (dates, decimals, durations...) become their Arrow
/// display string.
pub fn array_to_json(arr: &dyn Array) -> std::result::Result<Vec<Value>, ArrowError> {
    let n = arr.len();
    macro_rules! prim {
        ($t:ty) => {{
            let a = arr.as_primitive::<$t>();
            (0..n).map(|i| Value::from(a.value(i))).collect()
        }};
    }
    let mut out: Vec<Value> = match arr.data_type() {
        DataType::Null => vec![Value::Null; n],
        DataType::Boolean => {
            let a = arr.as_boolean();
            (0..n).map(|i| Value::Bool(a.value(i))).collect()
        }
        DataType::Int8 => prim!(Int8Type),
        DataType::Int16 => prim!(Int16Type),
        DataType::Int32 => prim!(Int32Type),
        DataType::Int64 => prim!(Int64Type),
        DataType::UInt8 => prim!(UInt8Type),
        DataType::UInt16 => prim!(UInt16Type),
        DataType::UInt32 => prim!(UInt32Type),
        DataType::UInt64 => prim!(UInt64Type),
        // serde_json maps non-finite floats to null, which is what JSON can carry.
        DataType::Float32 => prim!(Float32Type),
        DataType::Float64 => prim!(Float64Type),
        DataType::Float16 => {
            let a = arr.as_primitive::<Float16Type>();
            (0..n).map(|i| Value::from(a.value(i).to_f32())).collect()
        }
        DataType::Utf8 => strings(arr.as_string::<i32>().iter(), n),
        DataType::LargeUtf8 => strings(arr.as_string::<i64>().iter(), n),
        DataType::Utf8View => strings(arr.as_string_view().iter(), n),
        DataType::Binary => bytes(arr.as_binary::<i32>().iter(), n),
        DataType::LargeBinary => bytes(arr.as_binary::<i64>().iter(), n),
        DataType::BinaryView => bytes(arr.as_binary_view().iter(), n),
        DataType::FixedSizeBinary(_) => bytes(arr.as_fixed_size_binary().iter(), n),
        DataType::List(_) => {
            let a = arr.as_list::<i32>();
            let child = array_to_json(a.values().as_ref())?;
            slice_lists(child, a.value_offsets().iter().map(|&o| o as usize))
        }
        DataType::LargeList(_) => {
            let a = arr.as_list::<i64>();
            let child = array_to_json(a.values().as_ref())?;
            slice_lists(child, a.value_offsets().iter().map(|&o| o as usize))
        }
        DataType::FixedSizeList(_, size) => {
            let a = arr.as_fixed_size_list();
            let size = *size as usize;
            let child = array_to_json(a.values().as_ref())?;
            let start = a.value_offset(0).max(0) as usize;
            slice_lists(child, (0..=n).map(|i| start + i * size))
        }
        DataType::Struct(fields) => {
            let a = arr.as_struct();
            let mut children: Vec<Vec<Value>> = a
                .columns()
                .iter()
                .map(|c| array_to_json(c.as_ref()))
                .collect::<std::result::Result<_, _>>()?;
            (0..n)
                .map(|i| {
                    let mut obj = Map::new();
                    for (f, child) in fields.iter().zip(children.iter_mut()) {
                        obj.insert(f.name().clone(), std::mem::take(&mut child[i]));
                    }
                    Value::Object(obj)
                })
                .collect()
        }
        DataType::Map(_, _) => {
            let a = arr.as_map();
            let keys = array_to_json(a.keys().as_ref())?;
            let values = array_to_json(a.values().as_ref())?;
            let offsets = a.value_offsets();
            (0..n)
                .map(|i| {
                    let (s, e) = (offsets[i] as usize, offsets[i + 1] as usize);
                    let entries = keys[s..e].iter().zip(&values[s..e]);
                    if keys[s..e].iter().all(Value::is_string) {
                        Value::Object(
                            entries
                                .map(|(k, v)| {
                                    (k.as_str().unwrap_or_default().to_string(), v.clone())
                                })
                                .collect(),
                        )
                    } else {
                        Value::Array(
                            entries
                                .map(|(k, v)| Value::Array(vec![k.clone(), v.clone()]))
                                .collect(),
                        )
                    }
                })
                .collect()
        }
        DataType::Dictionary(_, value_type) => {
            let decoded = arrow_cast::cast(arr, value_type)?;
            array_to_json(decoded.as_ref())?
        }
        _ => {
            let fmt = ArrayFormatter::try_new(arr, &FormatOptions::default())?;
            (0..n)
                .map(|i| Value::String(fmt.value(i).to_string()))
                .collect()
        }
    };
    if arr.null_count() > 0 {
        for (i, v) in out.iter_mut().enumerate() {
            if arr.is_null(i) {
                *v = Value::Null;
            }
        }
    }
    Ok(out)
}

fn strings<'a>(it: impl Iterator<Item = Option<&'a str>>, n: usize) -> Vec<Value> {
    let mut out = Vec::with_capacity(n);
    out.extend(it.map(|s| s.map_or(Value::Null, |s| Value::String(s.to_string()))));
    out
}

fn bytes<'a>(it: impl Iterator<Item = Option<&'a [u8]>>, n: usize) -> Vec<Value> {
    let mut out = Vec::with_capacity(n);
    out.extend(it.map(|b| {
        b.map_or(Value::Null, |b| {
            Value::Array(b.iter().map(|&x| Value::from(x)).collect())
        })
    }));
    out
}

/// Cuts `child` into consecutive lists by `offsets` (len = rows + 1, absolute into `child`).
/// Offsets of a valid list array never overlap, so values can be moved out instead of cloned.
fn slice_lists(mut child: Vec<Value>, offsets: impl Iterator<Item = usize>) -> Vec<Value> {
    let offsets: Vec<usize> = offsets.collect();
    offsets
        .windows(2)
        .map(|w| {
            let (s, e) = (w[0].min(child.len()), w[1].min(child.len()));
            Value::Array(child[s..e.max(s)].iter_mut().map(std::mem::take).collect())
        })
        .collect()
}
