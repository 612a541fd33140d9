"""Reference data for verl-nn's parity tests, produced with transformers.

    hf_reference.py make OUT_DIR            tiny random checkpoints + reference outputs, one folder per case
    hf_reference.py check OURS_DIR REF_DIR HEAD [OURS_DIR REF_DIR HEAD ...]
                                            load checkpoints written by verl-nn with transformers
                                            (HEAD: causal, value or reward) and compare their outputs
                                            with REF_DIR/ref.safetensors (max abs diff <= 1e-6)

`make` writes, for every case, OUT_DIR/<case>/hf (save_pretrained, safetensors) and
OUT_DIR/<case>/ref.safetensors with the prompts, their attention masks and transformers' fp32 outputs.
Exit status is non-zero on any failure; the last line printed is a one-line verdict.
"""

import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file

import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

VOCAB = 1000
PAD = 0
GREEDY_STEPS = 32

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    pad_token_id=PAD,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.1,
)

# One tiny config per case; each exercises the family's distinguishing features.
CASES = {
    "llama": dict(model_type="llama", rope_theta=10000.0, tie_word_embeddings=False),
    "llama3_tied": dict(
        model_type="llama",
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
        tie_word_embeddings=True,
        attention_bias=True,
        num_hidden_layers=3,
    ),
    "mistral": dict(model_type="mistral", head_dim=32, sliding_window=16, rope_theta=10000.0),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen3": dict(model_type="qwen3", head_dim=32, num_key_value_heads=1, tie_word_embeddings=False),
    "mixtral": dict(
        model_type="mixtral",
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=None,
        rope_theta=1000000.0,
    ),
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=96,
        norm_topk_prob=True,
        num_hidden_layers=3,
        mlp_only_layers=[1],
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=False,
        num_hidden_layers=3,
        mlp_only_layers=[1],
        head_dim=16,
    ),
}

# Cases that also get value (token classification) and reward (sequence classification) heads.
HEAD_CASES = {"llama", "qwen3"}


def positions(mask):
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def prompts(seed):
    """A left-padded and a right-padded batch of 3 prompts (lengths 9, 14, 5), no pad ids inside."""
    g = torch.Generator().manual_seed(seed)
    lens = [9, 14, 5]
    t = max(lens)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g) for n in lens]
    left = torch.full((3, t), PAD, dtype=torch.long)
    right = torch.full((3, t), PAD, dtype=torch.long)
    lmask = torch.zeros((3, t), dtype=torch.long)
    rmask = torch.zeros((3, t), dtype=torch.long)
    for i, s in enumerate(seqs):
        left[i, t - len(s):] = s
        lmask[i, t - len(s):] = 1
        right[i, : len(s)] = s
        rmask[i, : len(s)] = 1
    return left, lmask, right, rmask


@torch.no_grad()
def outputs(model, ids, mask):
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask))
    return out.logits.float()


@torch.no_grad()
def greedy(model, ids, mask, steps):
    """Plain recompute-everything greedy loop; also the smallest top1-top2 logit margin seen."""
    margin = float("inf")
    new = []
    for _ in range(steps):
        logits = outputs(model, ids, mask)[:, -1, :]
        top = logits.topk(2, dim=-1).values
        margin = min(margin, float((top[:, 0] - top[:, 1]).min()))
        nxt = logits.argmax(-1, keepdim=True)
        new.append(nxt)
        ids = torch.cat([ids, nxt], 1)
        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
    return torch.cat(new, 1), margin


def perturb(model, seed):
    """Make norms, biases and the padding row non-trivial so every parameter matters."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def make(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    for seed, (case, extra) in enumerate(sorted(CASES.items())):
        kw = dict(COMMON)
        kw.update(extra)
        model_type = kw.pop("model_type")
        config = AutoConfig.for_model(model_type, **kw)
        config._attn_implementation = "sdpa"
        torch.manual_seed(1000 + seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        perturb(model, 1000 + seed)
        case_dir = os.path.join(out_dir, case)
        model.save_pretrained(os.path.join(case_dir, "hf"), safe_serialization=True)

        left, lmask, right, rmask = prompts(seed)
        ref = {
            "left_ids": left,
            "left_mask": lmask,
            "right_ids": right,
            "right_mask": rmask,
            "left_logits": outputs(model, left, lmask),
            "right_logits": outputs(model, right, rmask),
        }
        tokens, margin = greedy(model, left, lmask, GREEDY_STEPS)
        ref["greedy_left"] = tokens
        ref["greedy_margin"] = torch.tensor([margin])

        if case in HEAD_CASES:
            backbone = {k: v for k, v in model.state_dict().items() if k.startswith("model.")}
            for head, cls, labels in (
                ("value", AutoModelForTokenClassification, 1),
                ("reward", AutoModelForSequenceClassification, 1),
            ):
                hconfig = AutoConfig.for_model(model_type, **kw, num_labels=labels)
                hconfig._attn_implementation = "sdpa"
                torch.manual_seed(2000 + seed)
                hmodel = cls.from_config(hconfig, dtype=torch.float32).eval()
                missing, unexpected = hmodel.load_state_dict(backbone, strict=False)
                assert not unexpected and all(m.startswith("score.") for m in missing), (missing, unexpected)
                with torch.no_grad():
                    hmodel.score.weight.normal_(0, 0.5)
                    if hmodel.score.bias is not None:
                        hmodel.score.bias.fill_(0.25)
                hmodel.save_pretrained(os.path.join(case_dir, head), safe_serialization=True)
                for side, ids, mask in (("left", left, lmask), ("right", right, rmask)):
                    ref[f"{head}_{side}"] = outputs(hmodel, ids, mask)
        save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(case_dir, "ref.safetensors"))
        with open(os.path.join(case_dir, "case.json"), "w") as f:
            json.dump({"case": case, "model_type": model_type, "greedy_margin": margin}, f)
        print(f"{case}: ok (greedy margin {margin:.3g})")
    print(f"verdict: made {len(CASES)} cases with transformers {transformers.__version__}")


def check_one(ours_dir, ref_dir, head):
    cls = {
        "causal": AutoModelForCausalLM,
        "value": AutoModelForTokenClassification,
        "reward": AutoModelForSequenceClassification,
    }[head]
    model, info = cls.from_pretrained(ours_dir, output_loading_info=True, dtype=torch.float32)
    model.eval()
    problems = [f"{k}: {v}" for k, v in info.items() if v]
    ref = load_file(os.path.join(ref_dir, "ref.safetensors"))
    key = {"causal": "{side}_logits", "value": "value_{side}", "reward": "reward_{side}"}[head]
    worst = 0.0
    for side in ("left", "right"):
        ids, mask = ref[f"{side}_ids"], ref[f"{side}_mask"]
        got = outputs(model, ids, mask)
        want = ref[key.format(side=side)]
        if head != "reward":
            keep = mask.bool()
            got, want = got[keep], want[keep]
        worst = max(worst, float((got - want).abs().max()))
    if worst > 1e-6:
        problems.append(f"max abs diff {worst:.3g} > 1e-6")
    return problems, worst


def check(triples):
    failed = 0
    for ours_dir, ref_dir, head in triples:
        problems, worst = check_one(ours_dir, ref_dir, head)
        if problems:
            failed += 1
            print(f"FAIL {ours_dir} ({head}): " + "; ".join(problems))
        else:
            print(f"ok {ours_dir} ({head}): max abs diff {worst:.3g}")
    if failed:
        print(f"verdict: FAIL {failed} of {len(triples)} checkpoints")
        sys.exit(1)
    print(f"verdict: OK {len(triples)} checkpoints")


if __name__ == "__main__":
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    if len(sys.argv) == 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    elif len(sys.argv) >= 5 and sys.argv[1] == "check" and (len(sys.argv) - 2) % 3 == 0:
        args = sys.argv[2:]
        check([tuple(args[i : i + 3]) for i in range(0, len(args), 3)])
    else:
        print(__doc__)
        sys.exit(2)
