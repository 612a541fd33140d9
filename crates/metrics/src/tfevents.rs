//! TensorBoard event files written and read natively.
//!
//! A file is a sequence of records: `u64` payload length (little endian), masked CRC-32C of those 8 bytes, the
//! payload, masked CRC-32C of the payload. Each payload is an `Event` protobuf; the first carries
//! `file_version: "brain.Event:2"`, the others `wall_time`, `step` and a `Summary` of `simple_value` scalars,
//! or of one text (a string tensor of the `text` plugin, as PyTorch's `SummaryWriter.add_text` writes it).
//! Only those few protobuf fields are hand-encoded; the reader skips any field it does not know.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::{io, MetricsError, Result};

/// The version string TensorBoard expects in a file's first event.
pub const FILE_VERSION: &str = "brain.Event:2";

const fn crc32c_table() -> [u32; 256] {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0x82F6_3B78
            } else {
                c >> 1
            };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
}

static CRC32C_TABLE: [u32; 256] = crc32c_table();

/// CRC-32C (Castagnoli), as TFRecord uses.
pub fn crc32c(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc = CRC32C_TABLE[((crc ^ b as u32) & 0xFF) as usize] ^ (crc >> 8);
    }
    !crc
}

/// TFRecord's masking of a CRC, so that CRCs of data containing CRCs stay well distributed.
pub fn masked_crc32c(bytes: &[u8]) -> u32 {
    crc32c(bytes).rotate_right(15).wrapping_add(0xA282_EAD8)
}

// ---- protobuf encoding ------------------------------------------------------------------------------------

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_key(out: &mut Vec<u8>, field: u32, wire: u8) {
    put_varint(out, ((field as u64) << 3) | wire as u64);
}

fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_key(out, field, 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn encode_event(wall_time: f64, step: i64, what: &EventPayload<'_>) -> Vec<u8> {
    let mut ev = Vec::new();
    put_key(&mut ev, 1, 1); // Event.wall_time: double
    ev.extend_from_slice(&wall_time.to_le_bytes());
    if step != 0 {
        put_key(&mut ev, 2, 0); // Event.step: int64 (negative steps take ten bytes, as protobuf says)
        put_varint(&mut ev, step as u64);
    }
    match what {
        EventPayload::FileVersion(v) => put_bytes(&mut ev, 3, v.as_bytes()),
        EventPayload::Scalars(scalars) => {
            let mut summary = Vec::new();
            for (tag, value) in scalars.iter() {
                let mut val = Vec::new();
                put_bytes(&mut val, 1, tag.as_bytes()); // Summary.Value.tag
                put_key(&mut val, 2, 5); // Summary.Value.simple_value: float
                val.extend_from_slice(&(*value as f32).to_le_bytes());
                put_bytes(&mut summary, 1, &val); // Summary.value
            }
            put_bytes(&mut ev, 5, &summary); // Event.summary
        }
        EventPayload::Text { tag, text } => {
            let mut val = Vec::new();
            put_bytes(&mut val, 1, tag.as_bytes()); // Summary.Value.tag
            put_bytes(&mut val, 8, &string_tensor(text)); // Summary.Value.tensor
            put_bytes(&mut val, 9, &plugin_metadata(TEXT_PLUGIN)); // Summary.Value.metadata
            let mut summary = Vec::new();
            put_bytes(&mut summary, 1, &val); // Summary.value
            put_bytes(&mut ev, 5, &summary); // Event.summary
        }
    }
    ev
}

/// A `TensorProto` of dtype `DT_STRING` and shape `[1]` holding `text`.
fn string_tensor(text: &str) -> Vec<u8> {
    let mut dim = Vec::new();
    put_key(&mut dim, 1, 0); // TensorShapeProto.Dim.size
    put_varint(&mut dim, 1);
    let mut shape = Vec::new();
    put_bytes(&mut shape, 2, &dim); // TensorShapeProto.dim
    let mut tensor = Vec::new();
    put_key(&mut tensor, 1, 0); // TensorProto.dtype
    put_varint(&mut tensor, DT_STRING);
    put_bytes(&mut tensor, 2, &shape); // TensorProto.tensor_shape
    put_bytes(&mut tensor, 8, text.as_bytes()); // TensorProto.string_val
    tensor
}

/// A `SummaryMetadata` naming the plugin that shows the value. The text plugin's own data (`TextPluginData`,
/// version 0) encodes to nothing, so `PluginData.content` is left out, as protobuf leaves out empty fields.
fn plugin_metadata(plugin: &str) -> Vec<u8> {
    let mut plugin_data = Vec::new();
    put_bytes(&mut plugin_data, 1, plugin.as_bytes()); // PluginData.plugin_name
    let mut metadata = Vec::new();
    put_bytes(&mut metadata, 1, &plugin_data); // SummaryMetadata.plugin_data
    metadata
}

/// `tensorflow.DataType.DT_STRING`.
const DT_STRING: u64 = 7;
/// The TensorBoard plugin that renders string tensors as Markdown.
const TEXT_PLUGIN: &str = "text";

enum EventPayload<'a> {
    FileVersion(&'a str),
    Scalars(&'a [(String, f64)]),
    Text { tag: &'a str, text: &'a str },
}

fn frame_record(payload: &[u8]) -> Vec<u8> {
    let len = (payload.len() as u64).to_le_bytes();
    let mut rec = Vec::with_capacity(payload.len() + 16);
    rec.extend_from_slice(&len);
    rec.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    rec.extend_from_slice(payload);
    rec.extend_from_slice(&masked_crc32c(payload).to_le_bytes());
    rec
}

static FILE_COUNTER: AtomicUsize = AtomicUsize::new(0);

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

/// Appends scalar summaries to one `events.out.tfevents.*` file.
#[derive(Debug)]
pub struct EventWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl EventWriter {
    /// Create `dir` if needed and a new event file in it named as PyTorch's `SummaryWriter` names them
    /// (`events.out.tfevents.<unix time>.<host>.<pid>.<n>`), starting with the file-version event.
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(io("create the TensorBoard folder", dir))?;
        let wall = now();
        let name = format!(
            "events.out.tfevents.{:010}.{}.{}.{}",
            wall as u64,
            hostname(),
            std::process::id(),
            FILE_COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let path = dir.join(name);
        let file = File::create(&path).map_err(io("create", &path))?;
        let mut w = EventWriter {
            path,
            out: BufWriter::new(file),
        };
        w.write_event(wall, 0, &EventPayload::FileVersion(FILE_VERSION))?;
        w.flush()?;
        Ok(w)
    }

    /// The event file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Append one event holding every scalar of `step` (as `f32`, TensorBoard's `simple_value`).
    pub fn add_scalars(&mut self, step: i64, scalars: &[(String, f64)]) -> Result<()> {
        self.write_event(now(), step, &EventPayload::Scalars(scalars))
    }

    /// Append one event holding `text` (Markdown) under `<tag>/text_summary`, as PyTorch's
    /// `SummaryWriter.add_text(tag, text, step)` does: TensorBoard's Text tab shows it.
    pub fn add_text(&mut self, step: i64, tag: &str, text: &str) -> Result<()> {
        let tag = format!("{tag}/text_summary");
        self.write_event(now(), step, &EventPayload::Text { tag: &tag, text })
    }

    /// Push buffered records to the file.
    pub fn flush(&mut self) -> Result<()> {
        self.out.flush().map_err(io("write", &self.path))
    }

    fn write_event(&mut self, wall_time: f64, step: i64, what: &EventPayload<'_>) -> Result<()> {
        let rec = frame_record(&encode_event(wall_time, step, what));
        self.out.write_all(&rec).map_err(io("write", &self.path))
    }
}

impl Drop for EventWriter {
    fn drop(&mut self) {
        let _ = self.out.flush();
    }
}

// ---- reading ------------------------------------------------------------------------------------------------

/// One decoded event.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Event {
    /// Seconds since the Unix epoch.
    pub wall_time: f64,
    /// The global step.
    pub step: i64,
    /// Set on a file's first event.
    pub file_version: Option<String>,
    /// `(tag, simple_value)` of the event's summary.
    pub scalars: Vec<(String, f32)>,
    /// `(tag, text)` of the summary's values that the `text` plugin shows (a string tensor's first string).
    pub texts: Vec<(String, String)>,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn varint(&mut self) -> Option<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = *self.buf.get(self.pos)?;
            self.pos += 1;
            v |= ((b & 0x7F) as u64) << shift;
            if b & 0x80 == 0 {
                return Some(v);
            }
        }
        None
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let s = self.buf.get(self.pos..end)?;
        self.pos = end;
        Some(s)
    }

    fn done(&self) -> bool {
        self.pos >= self.buf.len()
    }

    /// Read one field: `(number, wire type, payload)`; varints come back as their 8 LE bytes.
    fn field(&mut self) -> Option<(u64, u8, Vec<u8>)> {
        let key = self.varint()?;
        let wire = (key & 7) as u8;
        let payload = match wire {
            0 => self.varint()?.to_le_bytes().to_vec(),
            1 => self.take(8)?.to_vec(),
            2 => {
                let n = self.varint()? as usize;
                self.take(n)?.to_vec()
            }
            5 => self.take(4)?.to_vec(),
            _ => return None,
        };
        Some((key >> 3, wire, payload))
    }
}

/// What one `Summary.Value` holds, of what this reader knows.
enum SummaryValue {
    Scalar(String, f32),
    Text(String, String),
    Other,
}

fn decode_value(buf: &[u8]) -> Option<SummaryValue> {
    let mut c = Cursor { buf, pos: 0 };
    let (mut tag, mut scalar, mut strings, mut plugin) = (None, None, None, None);
    while !c.done() {
        match c.field()? {
            (1, 2, b) => tag = Some(String::from_utf8(b).ok()?),
            (2, 5, b) => scalar = Some(f32::from_le_bytes(b.try_into().ok()?)),
            (8, 2, b) => strings = Some(decode_strings(&b)?),
            (9, 2, b) => plugin = decode_plugin_name(&b)?,
            _ => {}
        }
    }
    Some(match (tag, scalar, strings) {
        (Some(tag), Some(v), _) => SummaryValue::Scalar(tag, v),
        (Some(tag), None, Some(mut strings))
            if plugin.as_deref() == Some(TEXT_PLUGIN) && !strings.is_empty() =>
        {
            SummaryValue::Text(tag, strings.swap_remove(0))
        }
        _ => SummaryValue::Other,
    })
}

/// The `string_val`s of a `TensorProto`.
fn decode_strings(buf: &[u8]) -> Option<Vec<String>> {
    let mut c = Cursor { buf, pos: 0 };
    let mut strings = Vec::new();
    while !c.done() {
        if let (8, 2, b) = c.field()? {
            strings.push(String::from_utf8_lossy(&b).into_owned());
        }
    }
    Some(strings)
}

/// `SummaryMetadata.plugin_data.plugin_name`, if set.
fn decode_plugin_name(buf: &[u8]) -> Option<Option<String>> {
    let mut c = Cursor { buf, pos: 0 };
    let mut name = None;
    while !c.done() {
        if let (1, 2, plugin_data) = c.field()? {
            let mut p = Cursor {
                buf: &plugin_data,
                pos: 0,
            };
            while !p.done() {
                if let (1, 2, b) = p.field()? {
                    name = Some(String::from_utf8(b).ok()?);
                }
            }
        }
    }
    Some(name)
}

fn decode_event(buf: &[u8]) -> Option<Event> {
    let mut c = Cursor { buf, pos: 0 };
    let mut ev = Event::default();
    while !c.done() {
        match c.field()? {
            (1, 1, b) => ev.wall_time = f64::from_le_bytes(b.try_into().ok()?),
            (2, 0, b) => ev.step = i64::from_le_bytes(b.try_into().ok()?),
            (3, 2, b) => ev.file_version = Some(String::from_utf8(b).ok()?),
            (5, 2, b) => {
                let mut s = Cursor { buf: &b, pos: 0 };
                while !s.done() {
                    if let (1, 2, v) = s.field()? {
                        match decode_value(&v)? {
                            SummaryValue::Scalar(tag, x) => ev.scalars.push((tag, x)),
                            SummaryValue::Text(tag, text) => ev.texts.push((tag, text)),
                            SummaryValue::Other => {}
                        }
                    }
                }
            }
            _ => {}
        }
    }
    Some(ev)
}

/// Read every event of a tfevents file, checking both CRCs of every record.
pub fn read_events(path: &Path) -> Result<Vec<Event>> {
    let mut bytes = Vec::new();
    File::open(path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(io("read", path))?;
    let bad = |offset: usize, what: String| MetricsError::BadEvents {
        path: path.to_path_buf(),
        offset: offset as u64,
        what,
    };
    let mut events = Vec::new();
    let mut pos = 0usize;
    while pos < bytes.len() {
        let header = bytes.get(pos..pos + 12).ok_or_else(|| {
            bad(
                pos,
                format!(
                    "expected a 12-byte record header; found {} bytes",
                    bytes.len() - pos
                ),
            )
        })?;
        let (len_bytes, len_crc) = header.split_at(8);
        let expected = masked_crc32c(len_bytes);
        let found = u32::from_le_bytes(len_crc.try_into().expect("4 bytes"));
        if expected != found {
            return Err(bad(
                pos,
                format!("length CRC expected {expected:#010x}, found {found:#010x}"),
            ));
        }
        let len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes")) as usize;
        let start = pos + 12;
        let end = start
            .checked_add(len)
            .filter(|&e| e + 4 <= bytes.len())
            .ok_or_else(|| {
                bad(
                    pos,
                    format!("expected a {len}-byte payload and its CRC; the file ends first"),
                )
            })?;
        let payload = &bytes[start..end];
        let expected = masked_crc32c(payload);
        let found = u32::from_le_bytes(bytes[end..end + 4].try_into().expect("4 bytes"));
        if expected != found {
            return Err(bad(
                start,
                format!("payload CRC expected {expected:#010x}, found {found:#010x}"),
            ));
        }
        let ev = decode_event(payload)
            .ok_or_else(|| bad(start, "expected an Event protobuf".to_string()))?;
        events.push(ev);
        pos = end + 4;
    }
    Ok(events)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // The CRC-32C check value of "123456789" (RFC 3720 / iSCSI).
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn varints_round_trip_including_negative_steps() {
        for v in [0i64, 1, 127, 128, 300, 1 << 40, -1, i64::MIN] {
            let mut buf = Vec::new();
            put_varint(&mut buf, v as u64);
            let mut c = Cursor { buf: &buf, pos: 0 };
            assert_eq!(c.varint().map(|u| u as i64), Some(v));
            assert!(c.done());
        }
    }
}
