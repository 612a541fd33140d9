use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use verl_store::{DistEnv, StoreClient, StoreError, StoreServer};

const T: Duration = Duration::from_secs(5);

fn server() -> (StoreServer, std::net::SocketAddr) {
    let s = StoreServer::bind("127.0.0.1:0").expect("bind on a free port");
    let a = s.connect_addr();
    assert_ne!(a.port(), 0, "port 0 must be replaced by the real port");
    (s, a)
}

#[test]
fn set_then_get_returns_the_bytes_and_try_get_sees_absence() {
    let (_s, addr) = server();
    let c = StoreClient::connect(addr, T).unwrap();
    assert_eq!(c.try_get("k").unwrap(), None);
    c.set("k", b"\x00\x01value").unwrap();
    assert_eq!(c.get("k", T).unwrap(), b"\x00\x01value");
    assert_eq!(
        c.try_get("k").unwrap().as_deref(),
        Some(&b"\x00\x01value"[..])
    );
    assert!(c.delete("k").unwrap());
    assert!(!c.delete("k").unwrap());
}

#[test]
fn get_blocks_until_another_client_sets_the_key() {
    let (_s, addr) = server();
    let getter = thread::spawn(move || {
        let c = StoreClient::connect(addr, T).unwrap();
        let t0 = Instant::now();
        (c.get("late", T).unwrap(), t0.elapsed())
    });
    thread::sleep(Duration::from_millis(200));
    StoreClient::connect(addr, T)
        .unwrap()
        .set("late", b"x")
        .unwrap();
    let (v, waited) = getter.join().unwrap();
    assert_eq!(v, b"x");
    assert!(
        waited >= Duration::from_millis(150),
        "get returned before the set: {waited:?}"
    );
}

#[test]
fn get_times_out_naming_the_key() {
    let (_s, addr) = server();
    let c = StoreClient::connect(addr, T).unwrap();
    let err = c.get("never", Duration::from_millis(200)).unwrap_err();
    assert!(matches!(err, StoreError::GetTimeout { ref key, .. } if key == "never"));
    assert_eq!(err.to_string(), "key `never` was not set within 200ms");
}

#[test]
fn add_counts_across_threads() {
    let (_s, addr) = server();
    let handles: Vec<_> = (0..4)
        .map(|_| {
            thread::spawn(move || {
                let c = StoreClient::connect(addr, T).unwrap();
                for _ in 0..25 {
                    c.add("ctr", 2).unwrap();
                }
            })
        })
        .collect();
    handles.into_iter().for_each(|h| h.join().unwrap());
    let c = StoreClient::connect(addr, T).unwrap();
    assert_eq!(c.add("ctr", 0).unwrap(), 200);
    assert_eq!(c.add("ctr", -201).unwrap(), -1);
    c.set("blob", b"\xff\xfe").unwrap();
    let err = c.add("blob", 1).unwrap_err();
    assert!(
        matches!(err, StoreError::Refused { op: "add", .. }),
        "{err}"
    );
}

#[test]
fn wait_names_the_keys_still_missing() {
    let (_s, addr) = server();
    let c = StoreClient::connect(addr, T).unwrap();
    c.set("a", b"1").unwrap();
    let err = c
        .wait(&["a", "b", "c"], Duration::from_millis(100))
        .unwrap_err();
    match &err {
        StoreError::WaitTimeout { missing, .. } => assert_eq!(missing, &["b", "c"]),
        other => panic!("expected WaitTimeout, got {other}"),
    }
    c.set("b", b"").unwrap();
    c.set("c", b"").unwrap();
    c.wait(&["a", "b", "c"], T).unwrap();
}

#[test]
fn barrier_releases_all_four_ranks_and_is_reusable() {
    let (_s, addr) = server();
    let handles: Vec<_> = (0..4)
        .map(|rank| {
            thread::spawn(move || {
                let c = StoreClient::connect_as(addr, rank, T).unwrap();
                for round in 0..3 {
                    c.set(&format!("r{round}/{rank}"), b"").unwrap();
                    c.barrier("step", rank, 4, T).unwrap();
                    // After the barrier every rank's value of this round must be visible.
                    for peer in 0..4 {
                        assert!(c.try_get(&format!("r{round}/{peer}")).unwrap().is_some());
                    }
                }
            })
        })
        .collect();
    handles.into_iter().for_each(|h| h.join().unwrap());
}

#[test]
fn barrier_timeout_names_the_ranks_that_never_arrived() {
    let (_s, addr) = server();
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            thread::spawn(move || {
                let c = StoreClient::connect_as(addr, rank, T).unwrap();
                c.barrier("init", rank, 4, Duration::from_millis(300))
                    .unwrap_err()
            })
        })
        .collect();
    for h in handles {
        let err = h.join().unwrap();
        assert_eq!(
            err.to_string(),
            "rendezvous `init` timed out after 300ms: ranks 2, 3 of 4 never arrived"
        );
    }
}

#[test]
fn barrier_with_inconsistent_world_size_is_refused() {
    let (_s, addr) = server();
    let c0 = StoreClient::connect(addr, T).unwrap();
    let c1 = StoreClient::connect(addr, T).unwrap();
    let t = thread::spawn(move || c0.barrier("b", 0, 2, Duration::from_millis(500)));
    thread::sleep(Duration::from_millis(100));
    let err = c1.barrier("b", 1, 3, T).unwrap_err();
    assert!(
        err.to_string()
            .contains("world size 3, earlier ranks with 2"),
        "{err}"
    );
    assert!(t.join().unwrap().is_err());
}

#[test]
fn set_error_ends_blocked_gets_and_barriers_on_every_rank_within_a_second() {
    let (_s, addr) = server();
    let t0 = Instant::now();
    let blocked: Vec<_> = (0..3)
        .map(|rank| {
            thread::spawn(move || {
                let c = StoreClient::connect_as(addr, rank, T).unwrap();
                if rank == 0 {
                    c.get("never", Duration::from_secs(30)).unwrap_err()
                } else {
                    c.barrier("all", rank, 4, Duration::from_secs(30))
                        .unwrap_err()
                }
            })
        })
        .collect();
    thread::sleep(Duration::from_millis(200));
    let failing = StoreClient::connect_as(addr, 3, T).unwrap();
    failing
        .set_error(3, "CUDA out of memory in step 7")
        .unwrap();
    for h in blocked {
        let err = h.join().unwrap();
        assert_eq!(
            err.to_string(),
            "rank 3 failed: CUDA out of memory in step 7"
        );
        assert_eq!(err.failed_rank(), Some(3));
    }
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "took {:?}",
        t0.elapsed()
    );
    // The first failure sticks: later gets fail at once, a second failure does not replace it.
    failing.set_error(1, "secondary").unwrap();
    let c = StoreClient::connect(addr, T).unwrap();
    assert!(matches!(
        c.check_error(),
        Err(StoreError::RankFailed { rank: 3, .. })
    ));
    assert!(matches!(
        c.get("x", T),
        Err(StoreError::RankFailed { rank: 3, .. })
    ));
}

#[test]
fn a_rank_that_vanishes_without_goodbye_is_reported_as_failed() {
    let (_s, addr) = server();
    let waiter = thread::spawn(move || {
        StoreClient::connect_as(addr, 0, T)
            .unwrap()
            .get("never", Duration::from_secs(30))
            .unwrap_err()
    });
    thread::sleep(Duration::from_millis(100));
    // A dropped client says goodbye; a crash does not. Simulate the crash by leaking the client
    // after killing its socket.
    let crashed = StoreClient::connect_as(addr, 1, T).unwrap();
    crashed.shutdown_handle().unwrap().shutdown();
    std::mem::forget(crashed);
    let err = waiter.join().unwrap();
    assert_eq!(err.failed_rank(), Some(1), "{err}");
    assert!(err.to_string().contains("without saying goodbye"), "{err}");
}

#[test]
fn a_client_dropped_normally_is_not_a_failure() {
    let (_s, addr) = server();
    drop(StoreClient::connect_as(addr, 1, T).unwrap());
    thread::sleep(Duration::from_millis(100));
    StoreClient::connect(addr, T)
        .unwrap()
        .check_error()
        .unwrap();
}

#[test]
fn wait_error_returns_ok_on_timeout_and_the_failure_once_posted() {
    let (_s, addr) = server();
    let c = Arc::new(StoreClient::connect(addr, T).unwrap());
    c.wait_error(Duration::from_millis(50)).unwrap();
    let w = {
        let c = c.duplicate(T).unwrap();
        thread::spawn(move || c.wait_error(Duration::from_secs(30)))
    };
    thread::sleep(Duration::from_millis(100));
    c.set_error(2, "boom").unwrap();
    assert!(matches!(
        w.join().unwrap(),
        Err(StoreError::RankFailed { rank: 2, .. })
    ));
}

#[test]
fn clients_started_before_the_server_connect_once_it_is_up() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    let a2 = addr.clone();
    let client =
        thread::spawn(move || StoreClient::connect(a2.as_str(), T).map(|c| c.set("k", b"v")));
    thread::sleep(Duration::from_millis(200));
    let _s = StoreServer::bind(addr.as_str()).unwrap();
    client.join().unwrap().unwrap().unwrap();
}

#[test]
fn connect_to_nothing_fails_naming_the_address() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    let err = StoreClient::connect(addr.as_str(), Duration::from_millis(150))
        .err()
        .unwrap();
    assert!(err.to_string().contains(&addr), "{err}");
}

#[test]
fn dropping_the_server_unblocks_its_clients() {
    let (s, addr) = server();
    let c = StoreClient::connect(addr, T).unwrap();
    let t = thread::spawn(move || c.get("never", Duration::from_secs(30)));
    thread::sleep(Duration::from_millis(100));
    let t0 = Instant::now();
    drop(s);
    assert!(matches!(
        t.join().unwrap(),
        Err(StoreError::Io { op: "get", .. })
    ));
    assert!(t0.elapsed() < Duration::from_secs(2));
}

#[test]
fn dist_env_reads_torchrun_variables_and_names_bad_ones() {
    let vars = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    };
    let env = DistEnv::from_lookup(vars(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("MASTER_PORT", "29500"),
    ]))
    .unwrap();
    assert_eq!((env.rank, env.local_rank, env.world_size), (1, 1, 2));
    assert_eq!(env.master_addr, "127.0.0.1");
    assert!(!env.external_store);
    let err = DistEnv::from_lookup(vars(&[
        ("RANK", "2"),
        ("WORLD_SIZE", "2"),
        ("MASTER_PORT", "1"),
    ]))
    .unwrap_err();
    assert!(err.to_string().contains("RANK"), "{err}");
    let err = DistEnv::from_lookup(vars(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_PORT", "x"),
    ]))
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "environment variable MASTER_PORT: expected a TCP port (0-65535), found Some(\"x\")"
    );
}

#[test]
fn dist_env_join_starts_the_server_on_rank_zero_only() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let env = |rank| DistEnv {
        rank,
        world_size: 2,
        local_rank: rank,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        external_store: false,
    };
    let (server, c0) = env(0).join(T).unwrap();
    assert!(server.is_some());
    let (none, c1) = env(1).join(T).unwrap();
    assert!(none.is_none());
    c1.set("hello", b"from 1").unwrap();
    assert_eq!(c0.get("hello", T).unwrap(), b"from 1");
}
