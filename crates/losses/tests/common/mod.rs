//! Helpers shared by the integration tests.
#![allow(dead_code)]

use tch::{Kind, Tensor};

#[allow(unused_imports)] // each test binary uses a different subset
pub use verl_test_support::{shared_path, Lcg};

/// A float64 tensor from a (possibly nested) JSON array of numbers.
pub fn tensor_f64(v: &serde_json::Value) -> Tensor {
    let mut shape = Vec::new();
    let mut cur = v;
    while let Some(a) = cur.as_array() {
        shape.push(a.len() as i64);
        match a.first() {
            Some(first) => cur = first,
            None => break,
        }
    }
    let mut flat = Vec::new();
    flatten(v, &mut flat);
    Tensor::from_slice(&flat).reshape(&shape)
}

fn flatten(v: &serde_json::Value, out: &mut Vec<f64>) {
    match v {
        serde_json::Value::Array(a) => a.iter().for_each(|x| flatten(x, out)),
        other => out.push(
            other
                .as_f64()
                .unwrap_or_else(|| panic!("not a number: {other}")),
        ),
    }
}

pub fn to_vec(t: &Tensor) -> Vec<f64> {
    let t = t.to_kind(Kind::Double).contiguous().view(-1);
    Vec::<f64>::try_from(&t).expect("tensor to Vec<f64>")
}

/// Max relative deviation, with an absolute floor so exact zeros compare sanely.
pub fn max_rel_err(got: &[f64], want: &[f64], floor: f64) -> f64 {
    assert_eq!(got.len(), want.len(), "length mismatch");
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs() / w.abs().max(floor))
        .fold(0.0, f64::max)
}
