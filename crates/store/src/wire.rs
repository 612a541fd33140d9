//! Length-prefixed binary framing shared by the server and the client.
//!
//! Every integer is little-endian. Strings and byte strings carry a length prefix; lengths are
//! bounded so that a stray connection (a port scanner, a client of another protocol) cannot make
//! the server allocate gigabytes.

use std::io::{self, Read, Write};

pub(crate) const MAX_KEY_BYTES: usize = 64 * 1024;
pub(crate) const MAX_VALUE_BYTES: usize = 1 << 30;
pub(crate) const MAX_LIST_LEN: usize = 1 << 20;

/// First bytes of every connection, so a client of another protocol is refused at once.
pub(crate) const MAGIC: &[u8; 8] = b"verlstr1";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Op {
    Hello = 1,
    Set = 2,
    Get = 3,
    TryGet = 4,
    Add = 5,
    Wait = 6,
    Barrier = 7,
    SetError = 8,
    CheckError = 9,
    WaitError = 10,
    Delete = 11,
    Bye = 12,
}

impl Op {
    pub(crate) fn from_u8(b: u8) -> Option<Op> {
        Some(match b {
            1 => Op::Hello,
            2 => Op::Set,
            3 => Op::Get,
            4 => Op::TryGet,
            5 => Op::Add,
            6 => Op::Wait,
            7 => Op::Barrier,
            8 => Op::SetError,
            9 => Op::CheckError,
            10 => Op::WaitError,
            11 => Op::Delete,
            12 => Op::Bye,
            _ => return None,
        })
    }
}

/// Reply status byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Status {
    Ok = 0,
    /// A rank posted a failure: `u64 rank`, `str message` follow.
    RankFailed = 1,
    /// The request's deadline passed: an op-specific list of what was missing follows.
    Timeout = 2,
    /// The request was refused: `str message` follows.
    Refused = 3,
}

impl Status {
    pub(crate) fn from_u8(b: u8) -> Option<Status> {
        Some(match b {
            0 => Status::Ok,
            1 => Status::RankFailed,
            2 => Status::Timeout,
            3 => Status::Refused,
            _ => return None,
        })
    }
}

pub(crate) fn write_u8(w: &mut impl Write, v: u8) -> io::Result<()> {
    w.write_all(&[v])
}

pub(crate) fn write_u64(w: &mut impl Write, v: u64) -> io::Result<()> {
    w.write_all(&v.to_le_bytes())
}

pub(crate) fn write_i64(w: &mut impl Write, v: i64) -> io::Result<()> {
    w.write_all(&v.to_le_bytes())
}

pub(crate) fn write_bytes(w: &mut impl Write, v: &[u8]) -> io::Result<()> {
    write_u64(w, v.len() as u64)?;
    w.write_all(v)
}

pub(crate) fn write_str(w: &mut impl Write, v: &str) -> io::Result<()> {
    write_bytes(w, v.as_bytes())
}

pub(crate) fn read_u8(r: &mut impl Read) -> io::Result<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

pub(crate) fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

pub(crate) fn read_i64(r: &mut impl Read) -> io::Result<i64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(i64::from_le_bytes(b))
}

pub(crate) fn read_bytes(r: &mut impl Read, max: usize) -> io::Result<Vec<u8>> {
    let len = read_u64(r)? as usize;
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("length prefix {len} exceeds the limit of {max} bytes"),
        ));
    }
    let mut v = vec![0u8; len];
    r.read_exact(&mut v)?;
    Ok(v)
}

pub(crate) fn read_str(r: &mut impl Read, max: usize) -> io::Result<String> {
    String::from_utf8(read_bytes(r, max)?).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("string is not UTF-8: {e}"),
        )
    })
}

pub(crate) fn read_len(r: &mut impl Read) -> io::Result<usize> {
    let len = read_u64(r)? as usize;
    if len > MAX_LIST_LEN {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("list length {len} exceeds the limit of {MAX_LIST_LEN}"),
        ));
    }
    Ok(len)
}
