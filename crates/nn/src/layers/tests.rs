use super::*;

/// A shared-prompt layout as the actor builds it: per group its prompt, then each member's
/// response, the group's first row giving the prompt's outputs. Returns (gather, scatter,
/// rows, len, stream length).
fn shared_layout(groups: &[(usize, Vec<usize>)]) -> (Vec<i64>, Vec<i64>, i64, i64, usize) {
    let mut parts = Vec::new(); // (prompt at, prompt len, response at, response len, owner)
    let mut at = 0;
    for (plen, resps) in groups {
        let p_at = at;
        at += plen;
        for (j, &rl) in resps.iter().enumerate() {
            parts.push((p_at, *plen, at, rl, j == 0));
            at += rl;
        }
    }
    let len = parts.iter().map(|p| p.1 + p.3).max().unwrap();
    let (mut gather, mut scatter) = (Vec::new(), vec![0i64; at]);
    for (i, &(p_at, plen, r_at, rl, owner)) in parts.iter().enumerate() {
        gather.extend((p_at..p_at + plen).map(|k| k as i64));
        gather.extend((r_at..r_at + rl).map(|k| k as i64));
        gather.extend(std::iter::repeat_n(0, len - plen - rl));
        if owner {
            for k in 0..plen {
                scatter[p_at + k] = (i * len + k) as i64;
            }
        }
        for j in 0..rl {
            scatter[r_at + j] = (i * len + plen + j) as i64;
        }
    }
    (gather, scatter, parts.len() as i64, len as i64, at)
}

#[test]
fn varlen_layout_of_shared_prompts() {
    // Group 0: prompt 3, responses 2 and 1; group 1: prompt 2, response 3.
    let (gather, scatter, rows, len, n) = shared_layout(&[(3, vec![2, 1]), (2, vec![3])]);
    assert_eq!(n, 11);
    let (kv, cu_q, cu_k) = varlen_layout(&gather, &scatter, rows, len).unwrap();
    // Row 0: prompt 0..3 + response 3..5 (queries: all five); row 1: prompt + 5 (query: 5);
    // row 2: prompt 6..8 + response 8..11 (queries: all five).
    assert_eq!(kv, [0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 8, 9, 10]);
    assert_eq!(cu_q, [0, 5, 6, 11]);
    assert_eq!(cu_k, [0, 5, 9, 14]);
}

#[test]
fn varlen_layout_refuses_streams_out_of_row_order() {
    let (gather, mut scatter, rows, len, _) = shared_layout(&[(2, vec![1, 1])]);
    // Stream order: prompt (row 0), row 0's response, row 1's response; swap the last two.
    scatter.swap(2, 3);
    assert!(varlen_layout(&gather, &scatter, rows, len).is_none());
    // Outputs that skip a column of their row.
    let (gather, mut scatter, rows, len, _) = shared_layout(&[(2, vec![2])]);
    scatter[3] += 1;
    assert!(varlen_layout(&gather, &scatter, rows, len).is_none());
    // An index out of the rows.
    let (gather, mut scatter, rows, len, _) = shared_layout(&[(2, vec![2])]);
    scatter[3] = rows * len;
    assert!(varlen_layout(&gather, &scatter, rows, len).is_none());
}

/// The varlen form's semantics (each row's queries are the last of its keys, causal from the
/// bottom right), computed row by row with explicit masks, equal the padded rows' attention:
/// the contract the flash kernel is given on CUDA.
#[test]
fn varlen_form_equals_the_padded_rows() {
    tch::manual_seed(0);
    let (h, kvh, d) = (4i64, 2i64, 8i64);
    let (gather, scatter, rows, len, n) =
        shared_layout(&[(5, vec![3, 1, 4]), (2, vec![6]), (4, vec![0, 2])]);
    let ar = AttentionRows::from_host(&gather, &scatter, rows, len, Device::Cpu).unwrap();
    let vl = ar
        .varlen
        .as_ref()
        .expect("a shared-prompt stream has a varlen form");
    let n = n as i64;
    let q = Tensor::randn([n, h, d], (Kind::Double, Device::Cpu));
    let k = Tensor::randn([n, kvh, d], (Kind::Double, Device::Cpu));
    let v = Tensor::randn([n, kvh, d], (Kind::Double, Device::Cpu));
    // Padded rows, as `forward_rows` runs them without the varlen form.
    let heads = |x: Tensor| x.transpose(1, 2);
    let padded = causal_attention(
        &heads(ar.assemble(&q).unwrap()),
        &heads(ar.assemble(&k).unwrap()),
        &heads(ar.assemble(&v).unwrap()),
    )
    .unwrap();
    let want = ar.disperse(&padded).unwrap().squeeze_dim(0).transpose(0, 1);
    // Varlen, row by row.
    let cu = |t: &Tensor| Vec::<i64>::try_from(t.to_kind(Kind::Int64)).unwrap();
    let (cu_q, cu_k) = (cu(&vl.cu_q), cu(&vl.cu_k));
    let kk = k.index_select(0, &vl.kv_gather);
    let vv = v.index_select(0, &vl.kv_gather);
    let mut outs = Vec::new();
    for a in 0..rows as usize {
        let (q0, nq) = (cu_q[a], cu_q[a + 1] - cu_q[a]);
        let (k0, nk) = (cu_k[a], cu_k[a + 1] - cu_k[a]);
        if nq == 0 {
            continue;
        }
        assert!(nk >= nq, "row {a}: {nq} queries over {nk} keys");
        let qi = Tensor::arange(nq, (Kind::Int64, Device::Cpu)).view([-1, 1]);
        let ki = Tensor::arange(nk, (Kind::Int64, Device::Cpu)).view([1, -1]);
        let mask = ki.le_tensor(&(qi + (nk - nq)));
        let o = Tensor::scaled_dot_product_attention(
            &q.narrow(0, q0, nq).transpose(0, 1).unsqueeze(0),
            &kk.narrow(0, k0, nk).transpose(0, 1).unsqueeze(0),
            &vv.narrow(0, k0, nk).transpose(0, 1).unsqueeze(0),
            Some(mask),
            0.0,
            false,
            None,
            true,
        );
        outs.push(o.squeeze_dim(0).transpose(0, 1));
    }
    let got = Tensor::cat(&outs, 0);
    assert_eq!(got.size(), [n, h, d]);
    let diff = (&got - &want).abs().max().double_value(&[]);
    assert!(diff < 1e-12, "varlen form vs padded rows: {diff:.3e}");
}
