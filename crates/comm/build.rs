fn main() {
    // rustc links with --as-needed, which drops libtorch_cuda because nothing references it
    // directly; without it CUDA tensors are unavailable in the NCCL example and tests.
    println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
}
