//! libtorch's profiler through the shim: a trace started and stopped around CPU work is written
//! as a Chrome trace naming the aten ops that ran; a second stop without a start is an error.

use tch::{Device, Kind, Tensor};
use verl_torch_ext::{trace_start, trace_stop};

#[test]
fn a_trace_records_the_ops_between_start_and_stop() {
    let dir = std::env::temp_dir().join(format!("verl_trace_test_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.json");
    trace_start(true).unwrap();
    let a = Tensor::randn([64, 64], (Kind::Float, Device::Cpu));
    let b = a.matmul(&a).sum(Kind::Float);
    assert!(b.double_value(&[]).is_finite());
    trace_stop(&path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(
        text.contains("traceEvents"),
        "{}",
        &text[..text.len().min(300)]
    );
    assert!(
        text.contains("aten::matmul") || text.contains("aten::mm"),
        "no matmul op in the trace"
    );
    let e = trace_stop(&dir.join("u.json")).unwrap_err().to_string();
    assert!(e.contains("trace_stop"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}
