//! Durable filesystem primitives: fsync of files, folders and whole trees, and atomic small-file replacement.

use std::fs::{self, File};
use std::io::Write;
use std::path::Path;

use crate::error::{io, Result};

pub(crate) fn fsync_file(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io("fsync", path))
}

/// A rename is only durable once the folder holding the new entry is synced.
pub(crate) fn fsync_dir(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io("fsync folder", path))
}

/// Backends may not sync what they write; the rename that publishes a checkpoint must not overtake the data.
pub(crate) fn fsync_tree(path: &Path) -> Result<()> {
    for entry in fs::read_dir(path).map_err(io("list", path))? {
        let entry = entry.map_err(io("list", path))?;
        let kind = entry.file_type().map_err(io("stat", entry.path()))?;
        if kind.is_dir() {
            fsync_tree(&entry.path())?;
        } else if kind.is_file() {
            fsync_file(&entry.path())?;
        }
    }
    fsync_dir(path)
}

/// Replace `path` with `bytes` so that a reader sees either the old or the new content, never a torn file.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8], tag: &str) -> Result<()> {
    let parent = path.parent().unwrap_or_else(|| Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = parent.join(format!(".{name}.tmp-{tag}"));
    let result = (|| {
        let mut f = File::create(&tmp).map_err(io("create", &tmp))?;
        f.write_all(bytes).map_err(io("write", &tmp))?;
        f.sync_all().map_err(io("fsync", &tmp))?;
        drop(f);
        fs::rename(&tmp, path).map_err(io("rename into place", path))?;
        fsync_dir(parent)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

pub(crate) fn write_file_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).map_err(io("create", path))?;
    f.write_all(bytes).map_err(io("write", path))?;
    f.sync_all().map_err(io("fsync", path))
}

/// Remove a folder with its contents, or a file; a missing path is already removed.
pub(crate) fn remove_tree(path: &Path) -> Result<()> {
    let removed = match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) => Err(e),
    };
    match removed {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io("remove", path)(e)),
    }
}
