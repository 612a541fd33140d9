fn main() {
    verl_torch_build::configure();
}
