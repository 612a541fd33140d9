//! Writers for the formats the loader reads. Parquet is written the way pandas/pyarrow read it
//! back (3-level `list<struct>`, snappy), so files made here work with verl itself.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use arrow_array::RecordBatch;
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;
use serde_json::Value;

use crate::error::{DataError, Result};

fn create(path: &Path) -> Result<File> {
    File::create(path).map_err(|source| DataError::Write {
        path: path.to_path_buf(),
        source,
    })
}

/// Writes `batches` (one schema) as a snappy-compressed parquet file.
pub fn write_parquet(path: &Path, batches: &[RecordBatch]) -> Result<()> {
    let schema = match batches.first() {
        Some(b) => b.schema(),
        None => {
            return Err(DataError::EmptyDataset {
                paths: vec![path.to_path_buf()],
            })
        }
    };
    let pq = |source| DataError::Parquet {
        path: path.to_path_buf(),
        source,
    };
    let props = WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .build();
    let mut writer = ArrowWriter::try_new(create(path)?, schema, Some(props)).map_err(pq)?;
    for b in batches {
        writer.write(b).map_err(pq)?;
    }
    writer.close().map_err(pq)?;
    Ok(())
}

/// Writes `batches` in the Arrow IPC file format (`.arrow` / `.feather` v2), uncompressed.
pub fn write_arrow_ipc(path: &Path, batches: &[RecordBatch]) -> Result<()> {
    let schema = match batches.first() {
        Some(b) => b.schema(),
        None => {
            return Err(DataError::EmptyDataset {
                paths: vec![path.to_path_buf()],
            })
        }
    };
    let ar = |source| DataError::Arrow {
        path: path.to_path_buf(),
        source,
    };
    let mut writer = arrow_ipc::writer::FileWriter::try_new(BufWriter::new(create(path)?), &schema)
        .map_err(ar)?;
    for b in batches {
        writer.write(b).map_err(ar)?;
    }
    writer.finish().map_err(ar)?;
    Ok(())
}

/// Writes one JSON object per line.
pub fn write_jsonl<'a>(path: &Path, rows: impl IntoIterator<Item = &'a Value>) -> Result<()> {
    let w = |source| DataError::Write {
        path: path.to_path_buf(),
        source,
    };
    let mut out = BufWriter::new(create(path)?);
    for row in rows {
        serde_json::to_writer(&mut out, row).map_err(|e| w(e.into()))?;
        out.write_all(b"\n").map_err(w)?;
    }
    out.flush().map_err(w)?;
    Ok(())
}
