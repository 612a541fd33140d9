fn main() {
    // rustc links with --as-needed, which drops libtorch_cuda because nothing references it
    // directly; without it CUDA is silently unavailable at run time.
    println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
}
