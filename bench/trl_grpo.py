#!/usr/bin/env python3
"""Python reference timings for one GRPO step, to set beside `verl bench grpo` (issue 8, item 2).

Two systems, same workload, same random-init architecture (transformers, bf16, sdpa attention):

  --mode trl    TRL's GRPOTrainer, generation through HF `generate` (no vLLM), a constant reward.
                Phases are timed by wrapping the trainer's own methods (with a device sync at each edge):
                  gen           GRPOTrainer._generate_single_turn (pad prompts, model.generate, trim at EOS)
                  old_log_prob  _get_per_token_logps_and_entropies(policy) inside the scoring pass;
                                TRL skips it (0.0) when generation and optimisation are aligned
                                (one optimizer step per rollout, --mini-batches 1)
                  ref           _get_per_token_logps_and_entropies(ref model) inside the scoring pass
                  other         rest of _generate_and_score_completions (tokenise, decode, reward, advantages)
                  update        step - (gen + old_log_prob + ref + other): forward/backward micro-batches,
                                grad clipping, AdamW
                  step          on_step_begin of the step's first optimizer step to on_step_end of its last
  --mode plain  model.generate for the rollout, then an old log-prob forward, a reference log-prob forward and a
                PPO-clip (+k3 KL, token-mean over the mini-batch) update in micro-batches with AdamW on bf16
                params. Every phase is timed between device syncs. The old log-prob pass always runs (verl does).

--lora-rank R (> 0) trains a PEFT LoRA adapter (r R, --lora-alpha, --lora-targets, bias none) on the frozen base
instead of all weights. TRL gets it as GRPOTrainer(peft_config=LoraConfig(...)): TRL then builds no reference model
and takes the reference log-probs from the policy with its adapter disabled (`with model.disable_adapter()`), which
the ref phase times. Plain mode does the same: get_peft_model, AdamW over the adapter's parameters only, reference
log-probs inside `with model.disable_adapter()`. PEFT's defaults keep the adapter's weights in fp32 on a bf16 base.

Each run does --steps GRPO steps (the first warms up kernels and the allocator) and prints ONE JSON line on
stdout with the last step's phases; `per_step` lists them all. Progress goes to stderr.

tokens = prompts*n*(prompt_len+response_len) (prompt+response, verl's throughput convention);
tokens_per_s = tokens/step; gen_tokens_per_s = prompts*n*response_len/gen.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402

# Shapes copied by hand from the public config.json of each model (no download). `tiny` matches the `tiny`
# preset of crates/rollout/examples/gen_bench.rs.
ARCHS: dict[str, dict] = {
    "tiny": dict(
        model_type="qwen2", vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
    ),
    "qwen2.5-0.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
    ),
    "qwen2.5-1.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
    ),
    "llama3-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu", attention_bias=False, mlp_bias=False,
    ),
}


def log(msg: str) -> None:
    print(f"[trl_grpo] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------------
# set-up shared by both modes


class Clock:
    """Wall-clock timer that synchronises the device at each reading, so GPU work is counted where it ran."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def build_model(arch: str, device: torch.device, dtype: torch.dtype, eos_id: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(ARCHS[arch])
    model_type = shape.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **shape)
    cfg.bos_token_id = None
    cfg.eos_token_id = eos_id
    cfg.pad_token_id = eos_id
    cfg.use_cache = True
    with torch.device(device):  # initialise in place on the GPU: an 8B CPU init takes minutes
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
        except TypeError:  # transformers < 4.56 spells it torch_dtype
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype, attn_implementation="sdpa")
    model.to(device=device, dtype=dtype)
    model.generation_config.bos_token_id = None
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    return model


def build_tokenizer(vocab_size: int):
    """A word-level tokenizer over the model's whole vocabulary: id 0 '<unk>', id i 't{i}', last id the EOS (also
    used as pad). Whitespace-split text 't5 t17 ...' encodes to exactly those ids, and every id the model can
    sample decodes. Built in memory; no files, no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    eos = "<|eos|>"
    vocab = {"<unk>": 0}
    vocab.update({f"t{i}": i for i in range(1, vocab_size - 1)})
    vocab[eos] = vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token=eos, pad_token=eos)
    fast.padding_side = "left"
    return fast


def random_prompt_ids(num: int, prompt_len: int, vocab_size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size - 1, (num, prompt_len), generator=g)  # never <unk> or EOS


def lora_config(args):
    """The PEFT LoraConfig of --lora-rank/--lora-alpha/--lora-targets, or None without LoRA (--lora-rank 0)."""
    if args.lora_rank <= 0:
        return None
    from peft import LoraConfig

    targets = args.lora_targets
    if targets != "all-linear":
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    return LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, target_modules=targets, bias="none",
                      task_type="CAUSAL_LM")


def lora_fields(args, model) -> dict:
    """The JSON line's LoRA keys: rank, alpha, targets, trainable parameters and the adapter's dtype."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return {
        "lora_rank": args.lora_rank,
        "lora_alpha": args.lora_alpha if args.lora_rank > 0 else None,
        "lora_targets": args.lora_targets if args.lora_rank > 0 else None,
        "trainable_params": sum(p.numel() for p in trainable),
        "trainable_dtype": str(trainable[0].dtype).removeprefix("torch.") if trainable else None,
    }


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    for name in ("trl", "accelerate", "datasets", "tokenizers", "peft"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - absent is fine for --mode plain
            out[name] = None
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["cuda"] = torch.version.cuda
    return out


def finish(args, system: str, per_step: list[dict], model, extra: dict) -> None:
    last = dict(per_step[-1])
    b = args.prompts * args.n
    tokens = b * (args.prompt_len + args.response_len)
    resp = b * args.response_len
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() and args.device != "cpu" else None
    out = {
        "system": system,
        "arch": args.arch,
        "device": args.device,
        "dtype": args.dtype,
        "prompts": args.prompts,
        "n": args.n,
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "ignore_eos": args.ignore_eos,
        "micro_batch": args.micro_batch,
        "mini_batches": args.mini_batches,
        "grad_ckpt": args.grad_ckpt,
        "beta": args.beta,
        "steps": args.steps,
        "n_params": sum(p.numel() for p in model.parameters()),
        **lora_fields(args, model),
        **{k: round(last.get(k, 0.0), 4) for k in ("gen", "old_log_prob", "ref", "other", "update", "step")},
        "tokens": tokens,
        "response_tokens": resp,
        "tokens_per_s": round(tokens / last["step"], 1),
        "gen_tokens_per_s": round(resp / last["gen"], 1) if last.get("gen") else None,
        "peak_mem_gb": round(peak, 3) if peak is not None else None,
        "per_step": [{k: round(v, 4) for k, v in s.items()} for s in per_step],
        **extra,
        "versions": versions(),
    }
    line = json.dumps(out)
    print(line, flush=True)
    if args.json_out:
        with open(args.json_out, "a") as f:
            f.write(line + "\n")


# ----------------------------------------------------------------------------------------------------------------
# --mode plain


def response_logprobs(model, input_ids: torch.Tensor, attn: torch.Tensor, resp_len: int) -> torch.Tensor:
    """log p(token) for the last `resp_len` tokens of each row, in fp32. Only the logits that score response tokens
    are computed (logits_to_keep), and no [tokens x vocab] log-softmax is kept: logit[token] - logsumexp(logits)."""
    out = model(input_ids=input_ids, attention_mask=attn, logits_to_keep=resp_len + 1, use_cache=False)
    logits = out.logits[:, :-1, :].float()
    targets = input_ids[:, -resp_len:]
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def run_plain(args, device: torch.device, dtype: torch.dtype) -> None:
    vocab = ARCHS[args.arch]["vocab_size"]
    eos_id = vocab - 1
    torch.manual_seed(args.seed)
    policy = build_model(args.arch, device, dtype, eos_id)
    lora = lora_config(args)
    if args.grad_ckpt:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora is None:
        ref = copy.deepcopy(policy).eval().requires_grad_(False)
    else:
        from peft import get_peft_model

        policy = get_peft_model(policy, lora)  # freezes the base; the reference is the policy without its adapter
        ref = None
    policy.train()
    params = [p for p in policy.parameters() if p.requires_grad]
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=fused)
    gen_cfg = transformers.GenerationConfig(
        do_sample=True, temperature=args.temperature, top_p=1.0, top_k=0, max_new_tokens=args.response_len,
        min_new_tokens=args.response_len if args.ignore_eos else None, eos_token_id=eos_id, pad_token_id=eos_id,
        bos_token_id=None, use_cache=True, disable_compile=True,
    )
    clock = Clock(device)
    b = args.prompts * args.n
    mb = args.micro_batch
    lp_mb = args.logprob_micro_batch or mb
    if b % (mb * args.mini_batches):
        raise SystemExit(f"prompts*n = {b} must divide into {args.mini_batches} mini-batch(es) of micro-batch {mb}")
    mini = b // args.mini_batches
    per_step = []
    for step in range(args.steps):
        prompts = random_prompt_ids(args.prompts, args.prompt_len, vocab, args.seed + step)
        prompt_ids = prompts.repeat_interleave(args.n, dim=0).to(device)
        prompt_mask = torch.ones_like(prompt_ids)
        t: dict[str, float] = {}
        t0 = clock.now()

        # rollout
        policy.eval()
        with torch.no_grad():
            seqs = policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=gen_cfg)
        policy.train()
        t1 = clock.now()
        t["gen"] = t1 - t0
        resp_len = seqs.shape[1] - args.prompt_len
        if args.ignore_eos and resp_len != args.response_len:
            raise SystemExit(f"expected {args.response_len} response tokens, generate returned {resp_len}")
        # EOS mask (all ones with --ignore-eos): tokens after the first EOS do not count
        resp = seqs[:, args.prompt_len:]
        is_eos = resp == eos_id
        after = (is_eos.cumsum(-1) - is_eos.long()) > 0
        resp_mask = (~after).float()
        attn = torch.cat([prompt_mask, (~after).long()], dim=1)

        # old log-prob (policy, no grad), then reference log-prob
        def score(model):
            with torch.no_grad():
                return torch.cat([response_logprobs(model, seqs[i:i + lp_mb], attn[i:i + lp_mb], resp_len)
                                  for i in range(0, b, lp_mb)])

        old_lp = score(policy)
        t2 = clock.now()
        t["old_log_prob"] = t2 - t1
        if ref is None:
            with policy.disable_adapter():
                ref_lp = score(policy)
        else:
            ref_lp = score(ref)
        t3 = clock.now()
        t["ref"] = t3 - t2

        # reward (constant) and GRPO advantages: (r - mean_group) / (std_group + eps)
        rewards = torch.ones(b, device=device)
        grp = rewards.view(args.prompts, args.n)
        adv = ((grp - grp.mean(-1, keepdim=True)) / (grp.std(-1, keepdim=True) + 1e-6)).view(b, 1)
        t4 = clock.now()
        t["other"] = t4 - t3

        # PPO-clip update: mini-batches x micro-batches, token-mean over each mini-batch, grad clip 1.0, AdamW
        perm = torch.randperm(b, device=device)
        for m in range(args.mini_batches):
            idx_m = perm[m * mini:(m + 1) * mini]
            n_tok = resp_mask[idx_m].sum().clamp(min=1.0)
            for i in range(0, mini, mb):
                idx = idx_m[i:i + mb]
                lp = response_logprobs(policy, seqs[idx], attn[idx], resp_len)
                ratio = torch.exp(lp - old_lp[idx])
                a = adv[idx]
                pg = -torch.min(ratio * a, torch.clamp(ratio, 1 - args.clip, 1 + args.clip) * a)
                d = ref_lp[idx] - lp
                kl = torch.exp(d) - d - 1.0  # k3 estimator
                loss = ((pg + args.beta * kl) * resp_mask[idx]).sum() / n_tok
                loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        t5 = clock.now()
        t["update"] = t5 - t4
        t["step"] = t5 - t0
        per_step.append(t)
        log(f"plain step {step}: " + ", ".join(f"{k}={v:.3f}s" for k, v in t.items()))
    finish(args, "plain", per_step, policy, {"optimizer": f"torch.optim.AdamW(fused={fused})",
                                             "logprob_micro_batch": lp_mb})


# ----------------------------------------------------------------------------------------------------------------
# --mode trl


def run_trl(args, device: torch.device, dtype: torch.dtype) -> None:
    import trl
    import trl.trainer.grpo_trainer as grpo_mod
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    vocab = ARCHS[args.arch]["vocab_size"]
    eos_id = vocab - 1
    torch.manual_seed(args.seed)
    policy = build_model(args.arch, device, dtype, eos_id)
    tokenizer = build_tokenizer(vocab)
    assert tokenizer.eos_token_id == eos_id, (tokenizer.eos_token_id, eos_id)

    # GRPOTrainer builds its reference model by re-loading the policy's `_name_or_path`. A random-init model has no
    # path, so hand it a copy of the policy's initial weights instead (set-up only; nothing timed changes). With a
    # peft_config it builds none: the reference is the policy with its adapter disabled.
    lora = lora_config(args)
    initial = [copy.deepcopy(policy)] if lora is None else []
    orig_create = grpo_mod.create_model_from_path

    def create_ref(*_a, **_k):
        if not initial:
            raise RuntimeError("GRPOTrainer asked for a second model from a path; this script gives only one")
        return initial.pop()

    grpo_mod.create_model_from_path = create_ref

    # Text prompts that tokenize to exactly prompt_len ids; one fresh set of `prompts` prompts per step.
    ids = random_prompt_ids(args.prompts * args.steps, args.prompt_len, vocab, args.seed)
    texts = [" ".join(f"t{int(i)}" for i in row) for row in ids]
    enc = tokenizer(texts[:1])["input_ids"][0]
    assert len(enc) == args.prompt_len, f"prompt tokenizes to {len(enc)} tokens, expected {args.prompt_len}"
    dataset = Dataset.from_dict({"prompt": texts})

    def constant_reward(completions, **_kw):
        return [1.0] * len(completions)

    b = args.prompts * args.n
    mb = args.micro_batch
    if b % (mb * args.mini_batches):
        raise SystemExit(f"prompts*n = {b} must divide into {args.mini_batches} mini-batch(es) of micro-batch {mb}")
    grad_accum = b // (mb * args.mini_batches)
    out_dir = tempfile.mkdtemp(prefix="trl_grpo_")
    gen_kwargs = {"min_new_tokens": args.response_len} if args.ignore_eos else {}
    cfg = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=mb,
        gradient_accumulation_steps=grad_accum,
        generation_batch_size=b,  # the whole rollout (prompts x n) in one generate call, as TRL does per device
        num_generations=args.n,
        max_completion_length=args.response_len,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        generation_kwargs=gen_kwargs,
        beta=args.beta,
        epsilon=args.clip,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=args.steps * args.mini_batches,
        num_train_epochs=1,
        gradient_checkpointing=args.grad_ckpt,
        bf16=dtype == torch.bfloat16,
        use_cpu=device.type == "cpu",
        logging_steps=10**9,  # keep logging out of the timed window
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        shuffle_dataset=False,
        seed=args.seed,
        log_completions=False,
    )
    trainer = GRPOTrainer(model=policy, reward_funcs=constant_reward, args=cfg, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=lora)
    grpo_mod.create_model_from_path = orig_create
    initial.clear()  # unused when beta == 0 (no reference model): free it
    if lora is None and trainer.ref_model is None and args.beta != 0.0:
        raise SystemExit("GRPOTrainer built no reference model although beta != 0")
    if lora is not None and (trainer.ref_model is not None or not hasattr(trainer.model, "disable_adapter")):
        raise SystemExit("with peft_config, GRPOTrainer was expected to wrap the policy and build no reference model")

    clock = Clock(device)
    acc = {"gen": 0.0, "old_log_prob": 0.0, "ref": 0.0, "prepare": 0.0}
    state = {"in_prepare": False, "in_ref": False}

    def wrap(name, fn, key_of):
        def wrapped(*a, **k):
            key = key_of(*a, **k)
            if key is None:
                return fn(*a, **k)
            t0 = clock.now()
            try:
                return fn(*a, **k)
            finally:
                acc[key] += clock.now() - t0
        wrapped.__name__ = name
        return wrapped

    orig_gen = trainer._generate_single_turn
    trainer._generate_single_turn = wrap("_generate_single_turn", orig_gen, lambda *a, **k: "gen")

    orig_lp = trainer._get_per_token_logps_and_entropies

    def lp_key(model, *a, **k):
        if not state["in_prepare"]:
            return None  # a training forward: part of `update`
        if state["in_ref"] or (trainer.ref_model is not None and model is trainer.ref_model):
            return "ref"
        return "old_log_prob"

    # With PEFT, TRL scores the reference with the policy itself inside `use_adapter(model, None)` (adapter disabled).
    orig_use_adapter = grpo_mod.use_adapter

    @contextlib.contextmanager
    def use_adapter(*a, **k):
        with orig_use_adapter(*a, **k):
            state["in_ref"] = True
            try:
                yield
            finally:
                state["in_ref"] = False

    grpo_mod.use_adapter = use_adapter

    trainer._get_per_token_logps_and_entropies = wrap("_get_per_token_logps_and_entropies", orig_lp, lp_key)

    orig_prep = trainer._generate_and_score_completions

    def prep(*a, **k):
        state["in_prepare"] = True
        t0 = clock.now()
        try:
            return orig_prep(*a, **k)
        finally:
            acc["prepare"] += clock.now() - t0
            state["in_prepare"] = False

    trainer._generate_and_score_completions = prep

    per_step: list[dict] = []
    marks = {"begin": None}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, a, st, control, **kw):
            if st.global_step % args.mini_batches == 0:
                for k in acc:
                    acc[k] = 0.0
                marks["begin"] = clock.now()

        def on_step_end(self, a, st, control, **kw):
            if st.global_step % args.mini_batches == 0:  # global_step was already incremented
                step = clock.now() - marks["begin"]
                t = {"gen": acc["gen"], "old_log_prob": acc["old_log_prob"], "ref": acc["ref"],
                     "other": acc["prepare"] - acc["gen"] - acc["old_log_prob"] - acc["ref"],
                     "update": step - acc["prepare"], "step": step}
                per_step.append(t)
                log(f"trl step {len(per_step) - 1}: " + ", ".join(f"{k}={v:.3f}s" for k, v in t.items()))

    trainer.add_callback(StepTimer())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with contextlib.redirect_stdout(sys.stderr):  # Trainer prints its summary dict; stdout carries only our JSON
        trainer.train()
    if len(per_step) != args.steps:
        raise SystemExit(f"expected {args.steps} GRPO steps, timed {len(per_step)}")
    extra = {
        "optimizer": getattr(trainer.args.optim, "value", str(trainer.args.optim)),
        "trl_gradient_accumulation_steps": grad_accum,
        "trl_steps_per_generation": trainer.args.steps_per_generation,
        "trl_loss_type": trainer.args.loss_type,
        "trl_computes_old_log_prob": trainer.args.gradient_accumulation_steps
        % (trainer.args.steps_per_generation * trainer.num_iterations) != 0,
        "trl_version": trl.__version__,
    }
    finish(args, "trl", per_step, trainer.model, extra)


# ----------------------------------------------------------------------------------------------------------------


def number(text: str):
    """An int when integral (PEFT's lora_alpha is an int), else a float."""
    x = float(text)
    return int(x) if x.is_integer() else x


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["trl", "plain"], required=True)
    p.add_argument("--arch", choices=sorted(ARCHS), default="qwen2.5-0.5b")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--ignore-eos", action="store_true", help="fixed response length: min_new_tokens = max_new_tokens")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--steps", type=int, default=2, help="GRPO steps; the JSON reports the last (first = warm-up)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="sequences per forward/backward (TRL per_device_train_batch_size); default min(8, prompts*n)")
    p.add_argument("--logprob-micro-batch", type=int, default=None,
                   help="plain mode: sequences per old/ref log-prob forward (default --micro-batch; TRL uses "
                        "per_device_train_batch_size)")
    p.add_argument("--mini-batches", type=int, default=1, help="optimizer steps per rollout")
    p.add_argument("--beta", type=float, default=0.001, help="KL coefficient; > 0 so the reference pass runs")
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--grad-ckpt", action="store_true", help="activation recompute in the update (TRL's default)")
    p.add_argument("--lora-rank", type=int, default=0, help="train a PEFT LoRA adapter of this rank (0: all weights)")
    p.add_argument("--lora-alpha", type=number, default=16, help="LoRA alpha (verl's default 16); scale alpha/rank")
    p.add_argument("--lora-targets", default="all-linear",
                   help="LoRA target modules: all-linear (every linear layer but the LM head) or a comma list")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json-out", default=None, help="also append the JSON line to this file")
    args = p.parse_args()

    if args.micro_batch is None:
        args.micro_batch = min(8, args.prompts * args.n)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    log(f"mode={args.mode} arch={args.arch} device={device} torch={torch.__version__} "
        f"transformers={transformers.__version__}"
        + (f" lora r={args.lora_rank} alpha={args.lora_alpha} targets={args.lora_targets}" if args.lora_rank else ""))
    (run_trl if args.mode == "trl" else run_plain)(args, device, dtype)


if __name__ == "__main__":
    main()
