use super::*;

#[test]
fn workload_is_linear_plus_quadratic_in_the_length() {
    assert_eq!(calculate_workload(0), 0);
    assert_eq!(calculate_workload(1), 24577);
    assert_eq!(calculate_workload(4096), 24576 * 4096 + 4096 * 4096);
}

#[test]
fn workload_wraps_past_i64_like_torch_int64() {
    // torch.tensor([3_100_000_000]) → 24576 * s + s**2 == tensor([-8836667888109551616])
    assert_eq!(
        calculate_workload(3_100_000_000),
        -8_836_667_888_109_551_616
    );
}

#[test]
fn zero_partitions_is_an_invalid_parameter() {
    for result in [
        karmarkar_karp(&[1, 2], 0, false),
        get_seqlen_balanced_partitions(&[1, 2], 0, false),
        get_group_balanced_partitions(&[1, 2], &[0, 1], 0),
    ] {
        assert!(
            matches!(
                result,
                Err(AlgoError::InvalidParam {
                    key: "k_partitions",
                    ..
                })
            ),
            "{result:?}"
        );
    }
    let err = balance_batch(&[1, 2], 0, None).unwrap_err();
    assert!(
        matches!(err, AlgoError::InvalidParam { key: "dp_size", .. }),
        "{err}"
    );
    let err = log_seqlen_unbalance(&[1, 2], &[], "p").unwrap_err();
    assert!(
        matches!(
            err,
            AlgoError::InvalidParam {
                key: "partitions",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn karmarkar_karp_of_nothing_is_an_error() {
    let err = karmarkar_karp(&[], 2, false).unwrap_err();
    assert!(
        matches!(err, AlgoError::TooFewItems { found: 0, .. }),
        "{err}"
    );
}

#[test]
fn karmarkar_karp_leaves_partitions_empty_when_values_run_short() {
    // verl: karmarkar_karp([4], 3, False) == [[0], [], []]
    assert_eq!(
        karmarkar_karp(&[4], 3, false).unwrap(),
        vec![vec![0], vec![], vec![]]
    );
}

#[test]
fn fewer_values_than_partitions_is_an_error() {
    let err = get_seqlen_balanced_partitions(&[1, 2, 3], 4, false).unwrap_err();
    assert_eq!(
        err,
        AlgoError::TooFewItems {
            op: "get_seqlen_balanced_partitions",
            what: "values",
            found: 3,
            needed: 4,
            k: 4,
        }
    );
    assert_eq!(
        err.to_string(),
        "get_seqlen_balanced_partitions: 3 values for 4 partitions, expected at least 4"
    );
}

#[test]
fn equal_size_needs_a_count_the_partitions_divide() {
    let err = get_seqlen_balanced_partitions(&[1, 2, 3, 4, 5], 2, true).unwrap_err();
    assert!(
        matches!(err, AlgoError::NotDivisible { found: 5, k: 2, .. }),
        "{err}"
    );
    assert!(karmarkar_karp(&[1, 2, 3, 4, 5], 2, true).is_err());
}

#[test]
fn an_empty_partition_is_an_error() {
    // Only negative values can starve a partition: verl's karmarkar_karp([5, -3], 2, False) == [[0, 1], []].
    assert_eq!(
        karmarkar_karp(&[5, -3], 2, false).unwrap(),
        vec![vec![0, 1], vec![]]
    );
    let err = get_seqlen_balanced_partitions(&[5, -3], 2, false).unwrap_err();
    assert_eq!(
        err,
        AlgoError::EmptyPartition {
            op: "get_seqlen_balanced_partitions",
            index: 1,
            k: 2,
        }
    );
}

#[test]
fn equal_size_partitions_hold_the_same_number_of_rows_and_cover_every_row() {
    let values: Vec<i64> = (0..24).map(|i| (i * 37 % 11) * 100 + 5).collect();
    let partitions = get_seqlen_balanced_partitions(&values, 4, true).unwrap();
    assert!(partitions.iter().all(|p| p.len() == 6), "{partitions:?}");
    let mut all: Vec<usize> = partitions.concat();
    all.sort_unstable();
    assert_eq!(all, (0..24).collect::<Vec<_>>());
    assert!(partitions.iter().all(|p| p.windows(2).all(|w| w[0] < w[1])));
}

#[test]
fn group_ids_must_cover_every_row() {
    let err = get_group_balanced_partitions(&[1, 2, 3], &["a", "a"], 1).unwrap_err();
    assert!(
        matches!(
            err,
            AlgoError::LengthMismatch {
                expected: 3,
                found: 2,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn fewer_groups_than_partitions_is_an_error() {
    let err = get_group_balanced_partitions(&[5, 5, 1, 1], &["a", "a", "b", "b"], 4).unwrap_err();
    assert!(
        matches!(
            err,
            AlgoError::TooFewItems {
                what: "uid groups",
                found: 2,
                needed: 4,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn groups_are_runs_so_a_returning_uid_starts_a_new_group() {
    // Three runs (a, b, a) over three partitions: each run lands whole on its own partition.
    let partitions =
        get_group_balanced_partitions(&[5, 5, 1, 1, 9, 9], &["a", "a", "b", "b", "a", "a"], 3)
            .unwrap();
    let mut sorted = partitions.clone();
    sorted.sort();
    assert_eq!(sorted, vec![vec![0, 1], vec![2, 3], vec![4, 5]]);
    // Two groups over two partitions: not divisible with three runs.
    assert!(matches!(
        get_group_balanced_partitions(&[5, 5, 1, 1, 9, 9], &["a", "a", "b", "b", "a", "a"], 2),
        Err(AlgoError::NotDivisible { found: 3, k: 2, .. })
    ));
}

#[test]
fn a_group_workload_past_i64_is_an_error_not_a_wrap() {
    let err =
        get_group_balanced_partitions(&[3_000_000_000, 3_000_000_000], &[7, 7], 1).unwrap_err();
    assert!(matches!(err, AlgoError::Overflow { .. }), "{err}");
}

#[test]
fn unbalance_metrics_compare_the_original_chunks_with_the_partitions() {
    let seqlens = [1, 2, 3, 4, 5, 6, 7, 8];
    let partitions = [vec![0, 7], vec![1, 6], vec![2, 5], vec![3, 4]];
    let metrics = log_seqlen_unbalance(&seqlens, &partitions, "global_seqlen").unwrap();
    let expected = [
        ("global_seqlen/min", 3.0),
        ("global_seqlen/max", 15.0),
        ("global_seqlen/minmax_diff", 12.0),
        ("global_seqlen/balanced_min", 9.0),
        ("global_seqlen/balanced_max", 9.0),
        ("global_seqlen/mean", 9.0),
    ];
    assert_eq!(metrics, expected.map(|(k, v)| (k.to_owned(), v)).to_vec());
}

#[test]
fn unbalance_metrics_need_a_row_per_partition_and_indices_in_range() {
    let err = log_seqlen_unbalance(&[1], &[vec![0], vec![]], "p").unwrap_err();
    assert!(
        matches!(
            err,
            AlgoError::TooFewItems {
                found: 1,
                needed: 2,
                ..
            }
        ),
        "{err}"
    );
    let err = log_seqlen_unbalance(&[1, 2], &[vec![0], vec![2]], "p").unwrap_err();
    assert!(
        matches!(
            err,
            AlgoError::IndexOutOfRange {
                index: 2,
                len: 2,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn balanced_rows_put_the_lightest_at_both_ends_of_each_rank() {
    let seqlens = [10, 80, 30, 70, 20, 60, 40, 50];
    let out = balance_batch(&seqlens, 1, None).unwrap();
    // Sorted by workload: rows 0 4 2 6 7 5 3 1; even positions, then odd positions reversed.
    assert_eq!(out.ranks, vec![vec![0, 2, 7, 3, 1, 5, 6, 4]]);
    assert_eq!(out.row_order(), out.ranks[0]);
    assert_eq!(out.metrics[0].0, "global_seqlen/min");
}

#[test]
fn zigzag_handles_odd_and_tiny_lengths() {
    assert_eq!(zigzag(&[]), Vec::<usize>::new());
    assert_eq!(zigzag(&[4]), vec![4]);
    assert_eq!(zigzag(&[1, 2, 3, 4, 5]), vec![1, 3, 5, 4, 2]);
}

#[test]
fn prefix_groups_need_distinct_uids_divisible_by_dp_size() {
    let groups = Groups::from_keys(&["a", "a", "b", "b", "c", "c"]);
    let err = balance_batch(&[5, 5, 1, 1, 2, 2], 2, Some(&groups)).unwrap_err();
    assert_eq!(
        err,
        AlgoError::NotDivisible {
            op: "balance_batch",
            what: "distinct uids",
            found: 3,
            k: 2,
            hint: "make the batch size a multiple of dp_size × rollout.n",
        }
    );
}

#[test]
fn prefix_groups_must_cover_every_row() {
    let groups = Groups::from_keys(&["a", "a", "b"]);
    let err = balance_batch(&[5, 5, 1, 1], 2, Some(&groups)).unwrap_err();
    assert!(
        matches!(
            err,
            AlgoError::LengthMismatch {
                expected: 4,
                found: 3,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn prefix_groups_keep_each_prompt_on_one_rank_in_batch_order() {
    let groups = Groups::from_keys(&[0, 0, 1, 1, 2, 2, 3, 3]);
    let out = balance_batch(&[900, 10, 50, 60, 800, 20, 70, 40], 2, Some(&groups)).unwrap();
    for rank in &out.ranks {
        assert!(rank.windows(2).all(|w| w[0] < w[1]), "{rank:?}");
        assert!(rank
            .chunks(2)
            .all(|pair| groups.group_of(pair[0]) == groups.group_of(pair[1])));
    }
    // The two heavy prompts (rows 0–1 and 4–5) go to different ranks.
    assert_ne!(out.ranks[0].contains(&0), out.ranks[0].contains(&4));
}
