use super::*;
use verl_nn::{ModelOptions, Transformer};

/// A 3-layer fp32 Qwen2 model on the CPU (TP 1) and a `[2, 7]` batch.
fn tiny() -> (TpModel, Tensor, Tensor, Tensor) {
    let cfg = ModelConfig::from_value(
        serde_json::json!({
            "model_type": "qwen2", "vocab_size": 61, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
        }),
        "inline/config.json",
    )
    .unwrap();
    tch::manual_seed(3);
    let full = Transformer::new(
        cfg.clone(),
        &ModelOptions {
            device: Device::Cpu,
            dtype: Kind::Float,
            head: HeadKind::CausalLm,
        },
    )
    .unwrap();
    let mut named: std::collections::HashMap<String, Tensor> = full
        .named_parameters()
        .iter()
        .map(|(n, t)| (n.clone(), t.detach().copy()))
        .collect();
    let mut model = TpModel::new(
        cfg,
        HeadKind::CausalLm,
        Kind::Float,
        Device::Cpu,
        Arc::new(Group::single("tensor-parallel")),
        &mut named,
    )
    .unwrap();
    model.set_requires_grad(true).unwrap();
    let ids = Tensor::randint(61, [2, 7], (Kind::Int64, Device::Cpu));
    let mask = Tensor::ones([2, 7], (Kind::Int64, Device::Cpu));
    let positions = Tensor::arange(7, (Kind::Int64, Device::Cpu))
        .unsqueeze(0)
        .repeat([2, 1]);
    (model, ids, mask, positions)
}

/// One forward and backward (a log-softmax loss through the LM head): the loss and the
/// gradient the sink got per parameter.
fn run(
    model: &TpModel,
    ids: &Tensor,
    mask: &Tensor,
    positions: &Tensor,
) -> (Tensor, Vec<Option<Tensor>>) {
    let mut grads: Vec<Option<Tensor>> = (0..model.params.len()).map(|_| None).collect();
    let (loss, ()) = model
        .forward_backward(
            ids,
            mask,
            positions,
            MoeMicro::NONE,
            &mut |i, g| {
                grads[i] = Some(g.detach().copy());
                Ok(())
            },
            |h| {
                let w = model.whole_lm_head().expect("TP 1 holds the LM head");
                let logits = h.matmul(&w.tr());
                Ok((logits.log_softmax(-1, Kind::Float).mean(Kind::Float), ()))
            },
        )
        .unwrap();
    (loss, grads)
}

/// `set_recompute`: a training forward keeps the graphs of the dense layers not recomputed (an
/// inference forward keeps none), and the backward that chains them gives the recomputing
/// backward's parameter gradients and loss bit for bit.
#[test]
fn kept_activations_give_the_recomputed_gradients() {
    let (mut model, ids, mask, positions) = tiny();
    let (loss_re, grads_re) = run(&model, &ids, &mask, &positions);
    assert!(model
        .stage_forward_train(&ids, &mask, &positions, None)
        .unwrap()
        .kept
        .is_empty());
    model.set_recompute(Recompute::FirstOf(1));
    let acts = model
        .stage_forward_train(&ids, &mask, &positions, None)
        .unwrap();
    let kept: Vec<bool> = acts.kept.iter().map(Option::is_some).collect();
    assert_eq!(kept, [false, true, true]);
    let (loss_block, grads_block) = run(&model, &ids, &mask, &positions);
    model.set_recompute(Recompute::None);
    let acts = model
        .stage_forward_train(&ids, &mask, &positions, None)
        .unwrap();
    assert_eq!(acts.kept.len(), 3);
    assert!(acts.kept.iter().all(Option::is_some));
    assert!(model
        .stage_forward(&ids, &mask, &positions, None)
        .unwrap()
        .kept
        .is_empty());
    let (loss_kept, grads_kept) = run(&model, &ids, &mask, &positions);
    for (what, loss, grads) in [
        ("kept", &loss_kept, &grads_kept),
        ("first layer recomputed", &loss_block, &grads_block),
    ] {
        assert!(loss_re.equal(loss), "{what}: loss differs");
        let mut compared = 0;
        for (i, (a, b)) in grads_re.iter().zip(grads).enumerate() {
            let name = &model.params[i].name;
            match (a, b) {
                (Some(a), Some(b)) => {
                    assert!(a.equal(b), "{what}: {name}: gradients differ");
                    compared += 1;
                }
                (None, None) => {}
                _ => panic!("{what}: {name}: a gradient on one path only"),
            }
        }
        assert_eq!(compared, model.params.len(), "{what}");
    }
}

/// `set_grad_targets`: with every matrix given an accumulator, the decoder layers' projection
/// weights (q, k, v, o, gate, up, down of 3 layers) add their gradients there and reach the
/// sink with none; every other parameter (the embedding and LM head too) still goes to the
/// sink, with its gradient unchanged; recomputed or kept layers alike.
#[test]
fn gradient_targets_take_the_projection_weights_gradients() {
    let (mut model, ids, mask, positions) = tiny();
    let (loss_ref, grads_ref) = run(&model, &ids, &mask, &positions);
    for recompute in [Recompute::All, Recompute::None] {
        model.set_recompute(recompute);
        let targets: Vec<Option<Tensor>> = model
            .params
            .iter()
            .map(|p| (p.local.dim() == 2).then(|| p.local.detach().zeros_like()))
            .collect();
        model.set_grad_targets(Some(
            targets
                .iter()
                .map(|t| t.as_ref().map(Tensor::shallow_clone))
                .collect(),
        ));
        let (loss, grads) = run(&model, &ids, &mask, &positions);
        model.set_grad_targets(None);
        assert!(loss.equal(&loss_ref), "{recompute:?}: loss differs");
        let mut into = 0;
        for (i, p) in model.params.iter().enumerate() {
            let what = format!("{recompute:?}: {}", p.name);
            match (&grads_ref[i], &grads[i], &targets[i]) {
                (Some(want), None, Some(acc)) => {
                    let d = (acc - want).abs().max().double_value(&[]);
                    assert!(d < 1e-6, "{what}: accumulated gradient off by {d}");
                    into += 1;
                }
                (Some(want), Some(got), acc) => {
                    assert!(want.equal(got), "{what}: sink gradient differs");
                    if let Some(acc) = acc {
                        assert_eq!(acc.abs().sum(Kind::Float).double_value(&[]), 0.0, "{what}");
                    }
                }
                (None, None, _) => {}
                _ => panic!("{what}: gradient neither in the sink nor in its target"),
            }
        }
        assert_eq!(
            into,
            3 * 7,
            "{recompute:?}: projection weights accumulated in place"
        );
    }
}
