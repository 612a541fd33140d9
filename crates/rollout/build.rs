// Keeps libtorch_cuda linked into this package's tests and examples (the bench runs on CUDA).
fn main() {
    verl_torch_build::configure();
}
