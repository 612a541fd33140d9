fn main() {
    // Like the other crates that link libtorch: keep libtorch_cuda linked (only with `torch`).
    #[cfg(feature = "torch")]
    verl_torch_build::configure();
}
