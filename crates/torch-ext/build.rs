//! Compiles `src/shim.cpp` against the libtorch that tch builds against (found the same way:
//! `LIBTORCH`, else the `torch` package of `PYTHON_SYS_EXECUTABLE` / `python3`). CUDA support
//! (CUDA graphs) is compiled in when that libtorch has `libtorch_cuda` and the CUDA runtime
//! headers can be found (`CUDA_HOME`/`CUDA_PATH`, the pip `nvidia` packages next to torch, or
//! `/usr/local/cuda`).

use std::path::{Path, PathBuf};
use std::process::Command;

struct Torch {
    includes: Vec<PathBuf>,
    lib: PathBuf,
    cxx11_abi: String,
    site_packages: Option<PathBuf>,
}

fn locate() -> Torch {
    if let Ok(root) = std::env::var("LIBTORCH") {
        let root = PathBuf::from(root);
        return Torch {
            includes: vec![
                root.join("include"),
                root.join("include/torch/csrc/api/include"),
            ],
            lib: root.join("lib"),
            cxx11_abi: std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into()),
            site_packages: None,
        };
    }
    let python = std::env::var("PYTHON_SYS_EXECUTABLE").unwrap_or_else(|_| "python3".into());
    let script = "import os,torch\n\
                  d=os.path.dirname(torch.__file__)\n\
                  print(d)\n\
                  print(int(torch._C._GLIBCXX_USE_CXX11_ABI))";
    let out = Command::new(&python)
        .args(["-c", script])
        .output()
        .unwrap_or_else(|e| panic!("verl-torch-ext: running {python} to find torch: {e}"));
    if !out.status.success() {
        panic!(
            "verl-torch-ext: {python} could not import torch (set LIBTORCH or put the project's \
             .venv first on PATH: `source scripts/env.sh`): {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let mut lines = text.lines();
    let dir = PathBuf::from(lines.next().unwrap_or_default().trim());
    let abi = lines.next().unwrap_or("1").trim().to_string();
    Torch {
        includes: vec![
            dir.join("include"),
            dir.join("include/torch/csrc/api/include"),
        ],
        lib: dir.join("lib"),
        cxx11_abi: abi,
        site_packages: dir.parent().map(Path::to_path_buf),
    }
}

fn cuda_include(torch: &Torch) -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(v) = std::env::var(var) {
            candidates.push(PathBuf::from(v).join("include"));
        }
    }
    if let Some(sp) = &torch.site_packages {
        if let Ok(entries) = std::fs::read_dir(sp.join("nvidia")) {
            let mut dirs: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
            dirs.sort();
            for d in dirs {
                candidates.push(d.join("include"));
            }
        }
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    candidates
        .into_iter()
        .find(|d| d.join("cuda_runtime.h").exists() && d.join("crt/host_config.h").exists())
}

fn main() {
    println!("cargo:rerun-if-changed=src/shim.cpp");
    println!("cargo:rerun-if-changed=src/paged_attention.cpp");
    println!("cargo:rerun-if-changed=src/cuda_rt.h");
    println!("cargo:rerun-if-changed=src/ext_util.h");
    println!("cargo:rerun-if-changed=src/row_kernels.cpp");
    println!("cargo:rerun-if-changed=src/lt_gemm.cpp");
    for var in [
        "LIBTORCH",
        "LIBTORCH_CXX11_ABI",
        "PYTHON_SYS_EXECUTABLE",
        "CUDA_HOME",
        "CUDA_PATH",
        "VERL_TORCH_EXT_NO_CUDA",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let torch = locate();
    let has_cuda_lib = torch.lib.join("libtorch_cuda.so").exists();
    let cuda_inc = if has_cuda_lib && std::env::var_os("VERL_TORCH_EXT_NO_CUDA").is_none() {
        cuda_include(&torch)
    } else {
        None
    };
    if has_cuda_lib && cuda_inc.is_none() && std::env::var_os("VERL_TORCH_EXT_NO_CUDA").is_none() {
        println!(
            "cargo:warning=verl-torch-ext: libtorch has CUDA but no complete CUDA runtime headers \
             were found (cuda_runtime.h with crt/host_config.h; `bash scripts/setup.sh` installs \
             them): building without CUDA graphs"
        );
    }
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .file("src/shim.cpp")
        .file("src/paged_attention.cpp")
        .file("src/row_kernels.cpp")
        .file("src/lt_gemm.cpp")
        .includes(&torch.includes)
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={}", torch.cxx11_abi))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-deprecated-declarations")
        .warnings(false);
    if let Some(inc) = &cuda_inc {
        build.include(inc).define("VERL_WITH_CUDA", None);
    }
    build.compile("verl_torch_ext_shim");
    println!("cargo:rustc-link-search=native={}", torch.lib.display());
    if cuda_inc.is_some() {
        println!("cargo:rustc-link-lib=dylib=torch_cuda");
        println!("cargo:rustc-link-lib=dylib=c10_cuda");
        // rustc links with --as-needed, which drops libtorch_cuda from this package's tests and
        // examples (nothing there references it by symbol): CUDA would then be unavailable and
        // the GPU tests would skip on a GPU machine.
        for kind in ["tests", "examples"] {
            println!("cargo:rustc-link-arg-{kind}=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
        }
    }
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
    println!(
        "cargo:rustc-env=VERL_TORCH_EXT_CUDA={}",
        if cuda_inc.is_some() { "1" } else { "0" }
    );
}
