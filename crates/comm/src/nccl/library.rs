//! Finding and loading `libnccl.so.2`.
//!
//! Why not cudarc's own loader: cudarc 0.19 (`dynamic-loading`) opens NCCL by bare file names
//! derived from `"nccl"` (`libnccl.so`, `libnccl.so.13` from the CUDA major, `.12`, ..., `.1`) and
//! never `libnccl.so.2`, the soname the pip wheels (torch's `nvidia/nccl/lib/`) ship. A bare name
//! is resolved through `LD_LIBRARY_PATH`, which the dynamic linker reads once at process start,
//! so a symlink directory cannot be added later; cudarc has no environment variable or API to
//! take a path; and a missing library makes it panic. So we open the library ourselves by
//! absolute path (preferring the copy libtorch already mapped, so the process has one NCCL), keep
//! cudarc's `nccl::sys` type definitions for the C ABI, and resolve the handful of entry points we
//! call. Every failure is a [`CommError::NcclUnavailable`] listing where we looked.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use cudarc::nccl::sys::{cudaStream_t, ncclComm_t, ncclUniqueId};

use crate::CommError;

/// Set to the absolute path of a `libnccl.so*` to use it and nothing else.
pub const NCCL_LIBRARY_VAR: &str = "VERL_NCCL_LIBRARY";

type Res = c_int;

/// Where the search looked, and why it failed.
type Failure = (Vec<PathBuf>, String);

const NOT_FOUND: &str = "no libnccl.so.2 at any of the places searched";

/// The NCCL entry points this crate calls, resolved from one library.
#[allow(clippy::type_complexity)]
pub(crate) struct Api {
    pub get_version: unsafe extern "C" fn(*mut c_int) -> Res,
    pub get_unique_id: unsafe extern "C" fn(*mut ncclUniqueId) -> Res,
    pub comm_init_rank: unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> Res,
    pub comm_destroy: unsafe extern "C" fn(ncclComm_t) -> Res,
    pub comm_abort: unsafe extern "C" fn(ncclComm_t) -> Res,
    pub comm_get_async_error: unsafe extern "C" fn(ncclComm_t, *mut c_int) -> Res,
    pub get_error_string: unsafe extern "C" fn(Res) -> *const c_char,
    pub all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        u32,
        u32,
        ncclComm_t,
        cudaStream_t,
    ) -> Res,
    pub broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        u32,
        c_int,
        ncclComm_t,
        cudaStream_t,
    ) -> Res,
    pub reduce_scatter: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        u32,
        u32,
        ncclComm_t,
        cudaStream_t,
    ) -> Res,
    pub all_gather: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        u32,
        ncclComm_t,
        cudaStream_t,
    ) -> Res,
    pub send:
        unsafe extern "C" fn(*const c_void, usize, u32, c_int, ncclComm_t, cudaStream_t) -> Res,
    pub recv: unsafe extern "C" fn(*mut c_void, usize, u32, c_int, ncclComm_t, cudaStream_t) -> Res,
    pub group_start: unsafe extern "C" fn() -> Res,
    pub group_end: unsafe extern "C" fn() -> Res,
}

/// A loaded NCCL. Never unloaded: its entry points are used for the life of the process.
pub struct NcclLibrary {
    path: PathBuf,
    pub(crate) api: Api,
    _lib: libloading::Library,
}

impl std::fmt::Debug for NcclLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclLibrary")
            .field("path", &self.path)
            .finish()
    }
}

impl NcclLibrary {
    /// The process-wide NCCL, found once through [`NcclLibrary::search_paths`] (the result,
    /// success or failure, is remembered).
    pub fn get() -> Result<Arc<NcclLibrary>, CommError> {
        static LIB: OnceLock<Result<Arc<NcclLibrary>, Failure>> = OnceLock::new();
        LIB.get_or_init(|| {
            let mut searched = Vec::new();
            let first = Self::search(&mut searched, &mut Self::search_paths(false).into_iter());
            let found = match first {
                Ok(lib) => Ok(lib),
                Err(reason) => {
                    // Asking python where torch lives costs a process start: only as a fallback.
                    let late: Vec<PathBuf> = Self::search_paths(true)
                        .into_iter()
                        .filter(|p| !searched.contains(p))
                        .collect();
                    Self::search(&mut searched, &mut late.into_iter()).map_err(|r| {
                        if r.starts_with(NOT_FOUND) {
                            reason
                        } else {
                            r
                        }
                    })
                }
            };
            found.map(Arc::new).map_err(|reason| (searched, reason))
        })
        .clone()
        .map_err(|(searched, reason)| CommError::NcclUnavailable { searched, reason })
    }

    /// Loads the first loadable library among `paths` (in order).
    pub fn load_from(paths: &[PathBuf]) -> Result<NcclLibrary, CommError> {
        let mut searched = Vec::new();
        Self::search(&mut searched, &mut paths.iter().cloned())
            .map_err(|reason| CommError::NcclUnavailable { searched, reason })
    }

    fn search(
        searched: &mut Vec<PathBuf>,
        paths: &mut dyn Iterator<Item = PathBuf>,
    ) -> Result<NcclLibrary, String> {
        let mut last_error: Option<String> = None;
        for p in paths {
            searched.push(p.clone());
            // Bare names go to the dynamic linker's search; paths must exist to be worth a try.
            if p.components().count() > 1 && !p.exists() {
                continue;
            }
            match Self::open(&p) {
                Ok(lib) => return Ok(lib),
                Err(e) => last_error = Some(format!("{}: {e}", p.display())),
            }
        }
        Err(last_error.unwrap_or_else(|| NOT_FOUND.to_string()))
    }

    fn open(path: &Path) -> Result<NcclLibrary, String> {
        // SAFETY: loading NCCL runs only its (well-behaved) initialisers.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| e.to_string())?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the declared type matches NCCL's C prototype of the symbol.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("symbol {} missing: {e}", $name))?
            };
        }
        let api = Api {
            get_version: sym!("ncclGetVersion"),
            get_unique_id: sym!("ncclGetUniqueId"),
            comm_init_rank: sym!("ncclCommInitRank"),
            comm_destroy: sym!("ncclCommDestroy"),
            comm_abort: sym!("ncclCommAbort"),
            comm_get_async_error: sym!("ncclCommGetAsyncError"),
            get_error_string: sym!("ncclGetErrorString"),
            all_reduce: sym!("ncclAllReduce"),
            broadcast: sym!("ncclBroadcast"),
            reduce_scatter: sym!("ncclReduceScatter"),
            all_gather: sym!("ncclAllGather"),
            send: sym!("ncclSend"),
            recv: sym!("ncclRecv"),
            group_start: sym!("ncclGroupStart"),
            group_end: sym!("ncclGroupEnd"),
        };
        Ok(NcclLibrary {
            path: path.to_path_buf(),
            api,
            _lib: lib,
        })
    }

    /// Where the library was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// NCCL's version code (e.g. 22809 for 2.28.9).
    pub fn version(&self) -> Result<i32, CommError> {
        let mut v: c_int = 0;
        // SAFETY: `v` is a valid out-pointer.
        let code = unsafe { (self.api.get_version)(&mut v) };
        self.check("ncclGetVersion", code)?;
        Ok(v)
    }

    pub(crate) fn check(&self, op: &'static str, code: Res) -> Result<(), CommError> {
        if code == 0 {
            return Ok(());
        }
        // SAFETY: NCCL returns a static C string for any code.
        let msg = unsafe {
            let p = (self.api.get_error_string)(code);
            if p.is_null() {
                "unknown".to_string()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        Err(CommError::Nccl {
            op,
            code,
            message: msg,
        })
    }

    /// The places looked at, in order: [`NCCL_LIBRARY_VAR`]; a `libnccl` this process already
    /// mapped (libtorch_cuda's dependency); next to a mapped libtorch (`<torch>/../nvidia/nccl/lib`);
    /// under `$LIBTORCH`; (with `ask_python`) under the torch of `python3` on `PATH`; the system
    /// library directories; finally the bare soname for the dynamic linker's own search.
    pub fn search_paths(ask_python: bool) -> Vec<PathBuf> {
        const SONAME: &str = "libnccl.so.2";
        let mut out: Vec<PathBuf> = Vec::new();
        let mut push = |p: PathBuf| {
            if !out.contains(&p) {
                out.push(p);
            }
        };
        if let Some(p) = std::env::var_os(NCCL_LIBRARY_VAR) {
            push(PathBuf::from(p));
            return out;
        }
        let mapped = mapped_libraries();
        for m in &mapped {
            if file_name_starts(m, "libnccl.so") {
                push(m.clone());
            }
        }
        let wheel_nccl = |torch_dir: &Path| torch_dir.join("../nvidia/nccl/lib").join(SONAME);
        for m in &mapped {
            if file_name_starts(m, "libtorch_cuda.so") || file_name_starts(m, "libtorch_cpu.so") {
                if let Some(torch_dir) = m.parent().and_then(Path::parent) {
                    push(normalize(&wheel_nccl(torch_dir)));
                }
            }
        }
        if let Some(lt) = std::env::var_os("LIBTORCH") {
            let lt = PathBuf::from(lt);
            push(normalize(&wheel_nccl(&lt)));
            push(lt.join("lib").join(SONAME));
        }
        if ask_python {
            if let Some(torch_dir) = python_torch_dir() {
                push(normalize(&wheel_nccl(&torch_dir)));
            }
        }
        for dir in [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu",
            "/usr/lib64",
            "/usr/local/cuda/lib64",
            "/usr/local/nccl/lib",
            "/usr/local/lib",
        ] {
            push(Path::new(dir).join(SONAME));
        }
        push(PathBuf::from(SONAME));
        out
    }
}

fn file_name_starts(p: &Path, prefix: &str) -> bool {
    p.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with(prefix))
}

/// Resolves `..` lexically (the directories exist when the library does; no symlink games).
fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            std::path::Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// Shared objects mapped into this process, from `/proc/self/maps`.
fn mapped_libraries() -> Vec<PathBuf> {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = Vec::new();
    for line in maps.lines() {
        if let Some(i) = line.find('/') {
            let p = PathBuf::from(line[i..].trim_end());
            if p.to_string_lossy().contains(".so") && !out.contains(&p) {
                out.push(p);
            }
        }
    }
    out
}

/// The torch package directory of `python3` on `PATH`, found without importing torch (fast).
fn python_torch_dir() -> Option<PathBuf> {
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import importlib.util as u; s = u.find_spec('torch'); \
             print(s.submodule_search_locations[0] if s else '')",
        ])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    let s = String::from_utf8(out.stdout).ok()?;
    let s = s.trim();
    (!s.is_empty()).then(|| PathBuf::from(s))
}
