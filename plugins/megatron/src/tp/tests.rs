use super::*;

/// The layout test behind the causal (flash) attention path: rows whose real tokens come
/// first pass (with or without trailing padding, all padding too); a row with padding in
/// front or a hole does not.
#[test]
fn real_tokens_first_spots_front_padding_and_holes() {
    let rows = |v: &[&[i64]]| -> Tensor {
        let flat: Vec<i64> = v.iter().flat_map(|r| r.iter().copied()).collect();
        Tensor::from_slice(&flat)
            .view([v.len() as i64, v[0].len() as i64])
            .ne(0)
    };
    assert!(real_tokens_first(&rows(&[&[1, 1, 1, 1], &[1, 1, 0, 0], &[0, 0, 0, 0]])).unwrap());
    assert!(!real_tokens_first(&rows(&[&[1, 1, 1, 1], &[0, 1, 1, 1]])).unwrap());
    assert!(!real_tokens_first(&rows(&[&[1, 0, 1, 0]])).unwrap());
    assert!(real_tokens_first(&rows(&[&[1], &[0]])).unwrap());
}
