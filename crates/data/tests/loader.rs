mod common;

use std::sync::Arc;

use verl_data::{DataConfig, DataError, DataLoader, DataLoaderState, Dataset, LoaderOptions};

fn ds(n: usize) -> Arc<Dataset> {
    Arc::new(Dataset::from_samples(common::synthetic(n)))
}

fn ids(b: &verl_data::Batch) -> Vec<i64> {
    b.samples.iter().map(|s| s.extra_index().unwrap()).collect()
}

fn epoch_batches(loader: &mut DataLoader) -> Vec<Vec<usize>> {
    let epoch = loader.epoch();
    let mut out = Vec::new();
    while loader.epoch() == epoch {
        out.push(loader.next_batch().unwrap().indices);
    }
    out
}

#[test]
fn sequential_batches_drop_the_incomplete_tail() {
    let mut l = DataLoader::new(ds(10), 4, false, None, None).unwrap();
    assert_eq!(l.batches_per_epoch(), 2);
    assert_eq!(l.total_steps(3), 6);
    let b0 = l.next_batch().unwrap();
    assert_eq!(b0.indices, vec![0, 1, 2, 3]);
    assert_eq!(ids(&b0), vec![0, 1, 2, 3]);
    assert_eq!(
        (b0.epoch, b0.step_in_epoch, b0.last_in_epoch),
        (0, 0, false)
    );
    let b1 = l.next_batch().unwrap();
    assert_eq!(b1.indices, vec![4, 5, 6, 7]);
    assert!(b1.last_in_epoch);
    // Samples 8 and 9 are dropped (drop_last), the next epoch starts over.
    let b2 = l.next_batch().unwrap();
    assert_eq!((b2.epoch, b2.step_in_epoch), (1, 0));
    assert_eq!(b2.indices, vec![0, 1, 2, 3]);
}

#[test]
fn shuffle_is_reproducible_per_seed_and_differs_across_seeds_and_epochs() {
    let run = |seed| {
        let mut l = DataLoader::new(ds(100), 10, true, Some(seed), None).unwrap();
        (epoch_batches(&mut l), epoch_batches(&mut l))
    };
    let (a0, a1) = run(7);
    let (b0, _) = run(7);
    let (c0, _) = run(8);
    assert_eq!(a0, b0);
    assert_ne!(a0, c0);
    assert_ne!(a0, a1);
    // Each epoch visits every sample exactly once (100 divisible by 10: nothing dropped).
    for epoch in [&a0, &a1, &c0] {
        let mut all: Vec<usize> = epoch.iter().flatten().copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..100).collect::<Vec<_>>());
    }
    assert_ne!(a0.concat(), (0..100).collect::<Vec<_>>());
}

#[test]
fn resume_continues_at_the_exact_next_batch() {
    let data = ds(53);
    let mut full = DataLoader::new(data.clone(), 8, true, Some(3), None).unwrap();
    let reference: Vec<(u64, Vec<usize>)> = (0..20)
        .map(|_| {
            let b = full.next_batch().unwrap();
            (b.epoch, b.indices)
        })
        .collect();

    for stop in [0, 1, 5, 6, 7, 13] {
        let mut first = DataLoader::new(data.clone(), 8, true, Some(3), None).unwrap();
        for _ in 0..stop {
            first.next_batch().unwrap();
        }
        // Through serde, as a checkpoint would store it.
        let saved = serde_json::to_string(&first.state()).unwrap();
        let state: DataLoaderState = serde_json::from_str(&saved).unwrap();
        let mut resumed = DataLoader::new(data.clone(), 8, true, Some(3), Some(state)).unwrap();
        for (epoch, indices) in &reference[stop..] {
            let b = resumed.next_batch().unwrap();
            assert_eq!(
                (&b.epoch, &b.indices),
                (epoch, indices),
                "resume after {stop}"
            );
        }
    }
}

#[test]
fn state_records_a_random_seed_so_resume_without_seed_keeps_the_order() {
    let data = ds(40);
    let mut a = DataLoader::new(data.clone(), 5, true, None, None).unwrap();
    a.next_batch().unwrap();
    let st = a.state();
    assert_eq!(st.seed, a.seed());
    assert_eq!(
        (st.epoch, st.index_in_epoch, st.num_samples),
        (0, 5, Some(40))
    );
    let mut b = DataLoader::new(data, 5, true, None, Some(st)).unwrap();
    assert_eq!(
        a.next_batch().unwrap().indices,
        b.next_batch().unwrap().indices
    );
}

#[test]
fn state_at_epoch_end_points_at_the_next_epoch() {
    let mut l = DataLoader::new(ds(10), 5, true, Some(1), None).unwrap();
    l.next_batch().unwrap();
    l.next_batch().unwrap();
    let st = l.state();
    assert_eq!((st.epoch, st.index_in_epoch), (1, 0));
}

#[test]
fn resume_rejects_a_changed_dataset_or_seed() {
    let mut l = DataLoader::new(ds(20), 5, true, Some(1), None).unwrap();
    l.next_batch().unwrap();
    let st = l.state();
    let e = DataLoader::new(ds(21), 5, true, Some(1), Some(st)).unwrap_err();
    assert!(
        matches!(
            e,
            DataError::StateMismatch {
                field: "num_samples",
                ..
            }
        ),
        "{e:?}"
    );
    let s = e.to_string();
    assert!(s.contains("num_samples=20") && s.contains("21"), "{s}");
    let e = DataLoader::new(ds(20), 5, true, Some(2), Some(st)).unwrap_err();
    assert!(
        matches!(e, DataError::StateMismatch { field: "seed", .. }),
        "{e:?}"
    );
    let bad = DataLoaderState {
        index_in_epoch: 99,
        num_samples: None,
        ..st
    };
    let e = DataLoader::new(ds(20), 5, true, Some(1), Some(bad)).unwrap_err();
    assert!(
        matches!(
            e,
            DataError::StateMismatch {
                field: "index_in_epoch",
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn epochs_limit_ends_the_stream() {
    let opts = LoaderOptions {
        batch_size: 3,
        shuffle: true,
        seed: Some(4),
        drop_last: true,
        epochs: Some(2),
    };
    let l = DataLoader::with_options(ds(10), opts, None).unwrap();
    let batches: Vec<_> = l.collect();
    assert_eq!(batches.len(), 6);
    assert_eq!(batches[5].epoch, 1);
    assert!(batches.iter().all(|b| b.len() == 3));
}

#[test]
fn validation_loader_keeps_the_tail_and_defaults_to_one_batch() {
    let cfg = DataConfig {
        val_batch_size: Some(4),
        ..DataConfig::default()
    };
    let data = ds(10);
    let l = DataLoader::with_options(
        data.clone(),
        LoaderOptions::validation(&cfg, data.len()),
        None,
    )
    .unwrap();
    let sizes: Vec<usize> = l.map(|b| b.len()).collect();
    assert_eq!(sizes, vec![4, 4, 2]);

    let whole = DataLoader::with_options(
        data.clone(),
        LoaderOptions::validation(&DataConfig::default(), data.len()),
        None,
    )
    .unwrap();
    let all: Vec<_> = whole.collect();
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].indices, (0..10).collect::<Vec<_>>());
}

#[test]
fn train_options_follow_verl_config() {
    let cfg = DataConfig {
        train_batch_size: 8,
        gen_batch_size: Some(12),
        seed: Some(5),
        ..DataConfig::default()
    };
    let o = LoaderOptions::train(&cfg, Some(3));
    assert_eq!(
        (o.batch_size, o.shuffle, o.seed, o.drop_last, o.epochs),
        (12, true, Some(5), true, Some(3))
    );
}

#[test]
fn loader_that_cannot_fill_a_batch_is_an_error() {
    let e = DataLoader::new(ds(3), 4, true, Some(0), None).unwrap_err();
    assert!(
        matches!(
            e,
            DataError::EmptyLoader {
                num_samples: 3,
                batch_size: 4,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("3 samples, batch size 4"), "{e}");
    let e = DataLoader::new(ds(3), 0, true, Some(0), None).unwrap_err();
    assert!(matches!(e, DataError::InvalidConfig { .. }), "{e:?}");
}
