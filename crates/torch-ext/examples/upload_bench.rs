//! Host time of uploading batch-column-sized host data to the GPU (`upload_slice`: pinned block
//! from libtorch's caching host allocator + a copy that does not wait for the device), against a
//! pageable `from_slice` + blocking copy and `upload_slice_blocking`: `cargo run --release -p verl-torch-ext --example
//! upload_bench` (GPU machine). Prints ms per upload, the same Vec reused and a fresh Vec each time.
use std::time::Instant;
use tch::{Device, Kind, Tensor};

fn main() {
    let dev = Device::Cuda(0);
    let _warm = Tensor::zeros([1], (Kind::Float, dev));
    for &n in &[512 * 256usize, 512 * 512] {
        let v: Vec<i64> = (0..n as i64).collect();
        let line = |what: &str, f: &mut dyn FnMut() -> Tensor| {
            let mut ms = Vec::new();
            for _ in 0..8 {
                tch::Cuda::synchronize(0);
                let t = Instant::now();
                let x = f();
                ms.push(t.elapsed().as_secs_f64() * 1e3);
                tch::Cuda::synchronize(0);
                drop(x);
            }
            let s: Vec<String> = ms.iter().map(|m| format!("{m:.2}")).collect();
            println!("{what} {} MB: {}", (n * 8) >> 20, s.join(" "));
        };
        line("upload_slice, same vec", &mut || {
            verl_torch_ext::upload_slice(&v, &[n as i64], dev).unwrap()
        });
        line("upload_slice, fresh vec", &mut || {
            let w: Vec<i64> = (0..n as i64).collect();
            verl_torch_ext::upload_slice(&w, &[n as i64], dev).unwrap()
        });
        line("from_slice + blocking copy", &mut || {
            Tensor::from_slice(&v).to_device(dev)
        });
        line("upload_slice_blocking", &mut || {
            verl_torch_ext::upload_slice_blocking(&v, &[n as i64], dev).unwrap()
        });
        let mut keep = Vec::new();
        line("upload_slice, 6 alive at once", &mut || {
            keep.push(verl_torch_ext::upload_slice(&v, &[n as i64], dev).unwrap());
            if keep.len() > 6 {
                drop(keep.remove(0));
            }
            Tensor::zeros([1], (Kind::Float, dev))
        });
    }
}
