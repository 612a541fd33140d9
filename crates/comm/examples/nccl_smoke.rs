//! Smoke test of a backend on real ranks: spawns one process per GPU (or `--world N` CPU ranks),
//! runs every collective on known inputs, prints PASS/FAIL per check with timings, and an
//! all_reduce bandwidth figure.
//!
//! ```text
//! nccl_smoke                      # NCCL, one rank per visible GPU
//! nccl_smoke --backend cpu --world 4 --mib 16
//! nccl_smoke --own-stream         # collectives on the communicator's own stream, plus the
//!                                 # `_async` collectives overlapping queued compute
//! ```
//! Run the binary with torch's libraries on `LD_LIBRARY_PATH` (see TECH_NOTES).

use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};
use verl_comm::{init_from_env, Backend, ReduceOp};

struct Args {
    backend: Backend,
    world: Option<usize>,
    mib: usize,
    own_stream: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        backend: Backend::Nccl,
        world: None,
        mib: 256,
        own_stream: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--backend" => {
                a.backend = match value()?.as_str() {
                    "nccl" => Backend::Nccl,
                    "cpu" => Backend::Cpu,
                    other => return Err(format!("--backend: expected nccl or cpu, found {other}")),
                }
            }
            "--world" => a.world = Some(value()?.parse().map_err(|e| format!("--world: {e}"))?),
            "--mib" => a.mib = value()?.parse().map_err(|e| format!("--mib: {e}"))?,
            "--own-stream" => a.own_stream = true,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(a)
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("nccl_smoke: {e}");
            std::process::exit(2);
        }
    };
    let code = if std::env::var("RANK").is_ok() {
        rank_main(&args)
    } else {
        launcher_main(&args)
    };
    std::process::exit(code);
}

fn launcher_main(args: &Args) -> i32 {
    let world = args.world.unwrap_or_else(|| match args.backend {
        Backend::Nccl => tch::Cuda::device_count() as usize,
        Backend::Cpu => 2,
    });
    if world == 0 {
        println!("FAIL: no CUDA device visible to libtorch (is libtorch_cuda loaded?)");
        return 1;
    }
    let server = match verl_comm::StoreServer::bind("127.0.0.1:0") {
        Ok(s) => s,
        Err(e) => {
            println!("FAIL: {e}");
            return 1;
        }
    };
    let port = server.local_addr().port();
    println!(
        "launching {world} {} ranks (store on port {port})",
        args.backend.name()
    );
    let exe = std::env::current_exe().expect("own executable path");
    let t0 = Instant::now();
    let children: Vec<_> = (0..world)
        .map(|rank| {
            std::process::Command::new(&exe)
                .args(std::env::args().skip(1))
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env(verl_comm::EXTERNAL_STORE_VAR, "1")
                .spawn()
        })
        .collect();
    let mut ok = true;
    for (rank, c) in children.into_iter().enumerate() {
        match c.and_then(|mut c| c.wait()) {
            Ok(s) if s.success() => {}
            Ok(s) => {
                println!("rank {rank} exited with {s}");
                ok = false;
            }
            Err(e) => {
                println!("rank {rank} could not run: {e}");
                ok = false;
            }
        }
    }
    println!(
        "{} ({world} ranks, {:.1}s)",
        if ok { "PASS" } else { "FAIL" },
        t0.elapsed().as_secs_f64()
    );
    i32::from(!ok)
}

/// Small integers: exact in every dtype used and under any summation order (NCCL's differs).
fn values(rank: usize, n: i64, kind: Kind, device: Device) -> Tensor {
    Tensor::arange(n, (Kind::Int64, Device::Cpu))
        .g_add_scalar(rank as i64 * 3)
        .remainder(17)
        .to_kind(kind)
        .to_device(device)
}

fn rank_main(args: &Args) -> i32 {
    let dist = match init_from_env(args.backend, Duration::from_secs(120)) {
        Ok(d) => d,
        Err(e) => {
            println!("FAIL: init: {e}");
            return 1;
        }
    };
    let c = dist.comm.as_ref();
    let (r, w) = (c.rank(), c.world_size());
    let device = match args.backend {
        Backend::Nccl => Device::Cuda(dist.env.local_rank),
        Backend::Cpu => Device::Cpu,
    };
    let mut failures = 0;
    let mut check = |name: &str, f: &mut dyn FnMut() -> Result<bool, verl_comm::CommError>| {
        let t0 = Instant::now();
        let res = f().and_then(|ok| c.barrier().map(|_| ok));
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        match res {
            Ok(true) => println!("rank {r}: PASS {name} ({ms:.2} ms)"),
            Ok(false) => {
                failures += 1;
                println!("rank {r}: FAIL {name}: wrong values ({ms:.2} ms)");
            }
            Err(e) => {
                failures += 1;
                println!("rank {r}: FAIL {name}: {e}");
            }
        }
    };
    let sum_all = |n: i64, kind: Kind| {
        (0..w).fold(Tensor::zeros([n], (kind, device)), |acc, j| {
            acc + values(j, n, kind, device)
        })
    };

    if args.own_stream {
        // Only NCCL has a stream of its own; the CPU backend's async calls complete at once.
        check("use_own_stream", &mut || {
            c.use_own_stream()
                .map(|own| own == (args.backend == Backend::Nccl))
        });
        check("async collectives after queued compute", &mut || {
            // Inputs written by the default stream behind ~50 ms of matmuls: the collectives
            // must wait for them (and for nothing else to be read early).
            let m = if device.is_cuda() { 8192 } else { 128 };
            let a = Tensor::randn([m, m], (Kind::BFloat16, device)) / (m as f64).sqrt();
            let n = 1 << 20;
            let x = Tensor::empty([n], (Kind::BFloat16, device));
            let g = Tensor::empty([256 * w as i64], (Kind::Float, device));
            let mut b = a.shallow_clone();
            for _ in 0..20 {
                b = b.mm(&a);
            }
            let zero = b
                .sum(Kind::Float)
                .g_mul_scalar(0.0)
                .nan_to_num(0.0, 0.0, 0.0);
            x.shallow_clone()
                .copy_(&(values(r, n, Kind::BFloat16, device) + &zero));
            g.shallow_clone()
                .copy_(&(values(r, 256 * w as i64, Kind::Float, device) + &zero));
            let full = Tensor::empty([w as i64 * n], (Kind::BFloat16, device));
            let out = Tensor::empty([256], (Kind::Float, device));
            let p1 = c.all_gather_into_async(&full, &x)?;
            let p2 = c.reduce_scatter_async(&out, &g, ReduceOp::Sum)?;
            // The collectives keep their inputs alive.
            drop((x, g));
            // Compute queued meanwhile on the default stream may overlap them.
            let busy = a.mm(&a);
            p1.wait()?;
            p2.wait()?;
            let parts = full.chunk(w as i64, 0);
            let gathered = (0..w).all(|j| parts[j].equal(&values(j, n, Kind::BFloat16, device)));
            let reduced =
                out.equal(&sum_all(256 * w as i64, Kind::Float).narrow(0, 256 * r as i64, 256));
            Ok(gathered && reduced && busy.size() == [m, m])
        });
    }

    for kind in [
        Kind::Float,
        Kind::BFloat16,
        Kind::Half,
        Kind::Double,
        Kind::Int64,
    ] {
        check(&format!("all_reduce sum {kind:?}"), &mut || {
            let mut t = values(r, 4099, kind, device);
            c.all_reduce(&mut t, ReduceOp::Sum)?;
            Ok(t.equal(&sum_all(4099, kind)))
        });
    }
    check("all_reduce max", &mut || {
        let mut t = values(r, 1000, Kind::Float, device);
        c.all_reduce(&mut t, ReduceOp::Max)?;
        let want = (0..w).fold(values(0, 1000, Kind::Float, device), |a, j| {
            a.maximum(&values(j, 1000, Kind::Float, device))
        });
        Ok(t.equal(&want))
    });
    check("all_reduce avg", &mut || {
        let mut t = values(r, 1000, Kind::Float, device);
        c.all_reduce(&mut t, ReduceOp::Avg)?;
        let want = sum_all(1000, Kind::Float) / w as f64;
        Ok(t.allclose(&want, 1e-6, 1e-6, false))
    });
    check("all_gather", &mut || {
        let x = values(r, 333, Kind::BFloat16, device);
        let parts = c.all_gather(&x)?;
        Ok((0..w).all(|j| parts[j].equal(&values(j, 333, Kind::BFloat16, device))))
    });
    check("reduce_scatter sum", &mut || {
        let x = values(r, 256 * w as i64, Kind::Float, device);
        let mut out = Tensor::zeros([256], (Kind::Float, device));
        c.reduce_scatter(&mut out, &x, ReduceOp::Sum)?;
        Ok(out.equal(&sum_all(256 * w as i64, Kind::Float).narrow(0, 256 * r as i64, 256)))
    });
    check("broadcast", &mut || {
        let mut t = values(r, 777, Kind::Float, device);
        c.broadcast(&mut t, w - 1)?;
        Ok(t.equal(&values(w - 1, 777, Kind::Float, device)))
    });
    check("send_recv ring", &mut || {
        let x = values(r, 500, Kind::Float, device);
        let mut y = Tensor::zeros([500], (Kind::Float, device));
        c.send_recv(&x, (r + 1) % w, &mut y, (r + w - 1) % w)?;
        Ok(y.equal(&values((r + w - 1) % w, 500, Kind::Float, device)))
    });
    check("all_to_all equal", &mut || {
        let x = values(r, 4 * w as i64, Kind::Float, device);
        let mut y = Tensor::zeros([4 * w as i64], (Kind::Float, device));
        c.all_to_all(&mut y, &x)?;
        let want: Vec<Tensor> = (0..w)
            .map(|j| values(j, 4 * w as i64, Kind::Float, device).narrow(0, 4 * r as i64, 4))
            .collect();
        Ok(y.equal(&Tensor::cat(&want, 0)))
    });
    check("all_to_all unequal", &mut || {
        // Rank i sends (i + j) % 3 rows of 2 elements to rank j.
        let split = |i: usize, j: usize| (i + j) % 3;
        let ins: Vec<usize> = (0..w).map(|j| split(r, j)).collect();
        let outs: Vec<usize> = (0..w).map(|j| split(j, r)).collect();
        let rows = |i: usize| (0..w).map(|j| split(i, j)).sum::<usize>() as i64;
        let x = values(r, rows(r) * 2, Kind::Float, device).view([rows(r), 2]);
        let mut y = Tensor::zeros(
            [outs.iter().sum::<usize>() as i64, 2],
            (Kind::Float, device),
        );
        c.all_to_all_v(&mut y, &x, &outs, &ins)?;
        let want: Vec<Tensor> = (0..w)
            .map(|j| {
                let start = (0..r).map(|k| split(j, k)).sum::<usize>() as i64;
                values(j, rows(j) * 2, Kind::Float, device)
                    .view([rows(j), 2])
                    .narrow(0, start, split(j, r) as i64)
            })
            .collect();
        Ok(y.equal(&Tensor::cat(&want, 0)))
    });
    check("new_group(even ranks) all_reduce", &mut || {
        let evens: Vec<usize> = (0..w).step_by(2).collect();
        match c.new_group(&evens)? {
            None => Ok(true),
            Some(g) => {
                let mut t = values(r, 64, Kind::Float, device);
                g.all_reduce(&mut t, ReduceOp::Sum)?;
                let want = evens
                    .iter()
                    .fold(Tensor::zeros([64], (Kind::Float, device)), |a, j| {
                        a + values(*j, 64, Kind::Float, device)
                    });
                Ok(t.equal(&want))
            }
        }
    });

    // Bandwidth: bf16 all_reduce of `mib` MiB, bus bandwidth as nccl-tests reports it.
    let n = (args.mib * 1024 * 1024 / 2) as i64;
    let mut t = Tensor::ones([n], (Kind::BFloat16, device));
    let iters = 10;
    let timed = (|| -> Result<f64, verl_comm::CommError> {
        c.all_reduce(&mut t, ReduceOp::Sum)?;
        c.barrier()?;
        let t0 = Instant::now();
        for _ in 0..iters {
            c.all_reduce(&mut t, ReduceOp::Sum)?;
        }
        c.barrier()?;
        Ok(t0.elapsed().as_secs_f64() / iters as f64)
    })();
    match timed {
        Ok(s) => {
            let bus = 2.0 * (w as f64 - 1.0) / w as f64 * (n as f64 * 2.0) / s / 1e9;
            if r == 0 {
                println!(
                    "all_reduce bf16 {} MiB x {w} ranks: {:.3} ms, bus bandwidth {bus:.2} GB/s",
                    args.mib,
                    s * 1e3
                );
            }
        }
        Err(e) => {
            failures += 1;
            println!("rank {r}: FAIL bandwidth all_reduce: {e}");
        }
    }
    if failures > 0 {
        c.abort(&format!("{failures} smoke checks failed on rank {r}"));
        return 1;
    }
    0
}
