// rustc links with --as-needed, which drops libtorch_cuda (nothing references it by symbol) and leaves CUDA
// silently unavailable; keep it so this package's test binaries can exercise the GPU (see TECH_NOTES.md).
fn main() {
    println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
}
