"""Reference data for verl-nn's LoRA parity tests, produced with the real PEFT package (peft==0.21.2).

    peft_reference.py logits BASE_DIR ADAPTER_DIR INPUTS OUT
        Load BASE_DIR (an HF checkpoint: config.json + model.safetensors) with AutoModelForCausalLM in fp32
        (eager attention), put the PEFT LoRA adapter of ADAPTER_DIR (adapter_config.json +
        adapter_model.safetensors) on it with PeftModel.from_pretrained, and write OUT (safetensors):
            logits       float32 [B, T, V]  the model with the adapter
            base_logits  float32 [B, T, V]  the same model inside `with model.disable_adapter():`
        INPUTS is a safetensors file with input_ids and attention_mask (int64 [B, T]); position_ids are
        cumsum(attention_mask) - 1 clamped at 0 (left padding), passed explicitly.
        Fails (exit status 1) when PEFT put LoRA on no module, when an adapter key of the file is missing
        from the model or the model has a LoRA weight the file lacks, or when a loaded weight differs from
        the file's.

    peft_reference.py make-adapter BASE_DIR OUT_DIR --rank R --alpha A [--targets all-linear|q_proj,v_proj,...]
                                    [--seed S]
        Make a PEFT LoRA adapter for BASE_DIR (LoraConfig(r, lora_alpha, target_modules, bias="none",
        task_type="CAUSAL_LM", init_lora_weights=False): B is nonzero, so the adapter changes the output) after
        torch.manual_seed(S), and save it to OUT_DIR with save_pretrained (adapter_config.json +
        adapter_model.safetensors).

Both print one summary line; the last line printed is the verdict.
"""

import argparse
import json
import os
import sys
import warnings

import torch
from safetensors.torch import load_file, save_file

import peft
import transformers
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from transformers import AutoModelForCausalLM

ADAPTER = "default"


def fail(msg):
    print(f"peft_reference: FAIL: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def load_base(base_dir):
    try:
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32, attn_implementation="eager")
    return model.float().eval()


def lora_modules(model):
    """Names of the modules that carry the LoRA adapter ADAPTER."""
    return [name for name, m in model.named_modules() if isinstance(m, LoraLayer) and ADAPTER in m.lora_A]


def positions(mask):
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def cmd_logits(args):
    weights_path = os.path.join(args.adapter_dir, "adapter_model.safetensors")
    config_path = os.path.join(args.adapter_dir, "adapter_config.json")
    for path in (weights_path, config_path):
        if not os.path.isfile(path):
            fail(f"{path} does not exist")
    with open(config_path) as f:
        cfg = json.load(f)
    if cfg.get("peft_type") != "LORA":
        fail(f"{config_path}: peft_type is {cfg.get('peft_type')!r}, expected 'LORA'")

    base = load_base(args.base_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model = PeftModel.from_pretrained(base, args.adapter_dir, adapter_name=ADAPTER)
        except Exception as e:  # noqa: BLE001 - e.g. a shape mismatch or target_modules that match nothing
            fail(f"PEFT could not load {args.adapter_dir}: {type(e).__name__}: {e}")
    for w in caught:
        text = str(w.message)
        if "missing adapter keys" in text or "mismatched" in text:
            fail(f"PEFT: {text}")
        print(f"peft_reference: warning from loading: {text}", file=sys.stderr)
    model.eval()

    modules = lora_modules(model)
    if not modules:
        fail(f"PEFT put LoRA on no module of {args.base_dir} (target_modules {cfg.get('target_modules')!r})")

    # PEFT's own check (a warning) covers only missing keys and ignores the file's extra keys: compare both
    # ways, shapes and values, against what the model now holds.
    file_sd = load_file(weights_path)
    model_sd = {k: v.detach().cpu() for k, v in get_peft_model_state_dict(model, adapter_name=ADAPTER).items()}
    missing = sorted(set(model_sd) - set(file_sd))
    unexpected = sorted(set(file_sd) - set(model_sd))
    if missing:
        fail(f"{len(missing)} adapter key(s) missing from {weights_path}, e.g. {missing[:4]}")
    if unexpected:
        fail(f"{len(unexpected)} unexpected key(s) in {weights_path} (no such adapter weight), e.g. {unexpected[:4]}")
    for k, v in file_sd.items():
        if tuple(v.shape) != tuple(model_sd[k].shape):
            fail(f"{k}: shape {tuple(v.shape)} in the file, {tuple(model_sd[k].shape)} in the model")
        if not torch.equal(v.to(model_sd[k].dtype), model_sd[k]):
            fail(f"{k}: the loaded weight differs from the file's")

    inputs = load_file(args.inputs)
    ids = inputs["input_ids"].long()
    mask = inputs["attention_mask"].long()
    if ids.shape != mask.shape or ids.dim() != 2:
        fail(f"input_ids {tuple(ids.shape)} and attention_mask {tuple(mask.shape)} must both be [B, T]")
    pos = positions(mask)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
        with model.disable_adapter():
            base_logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    save_file({"logits": logits.contiguous(), "base_logits": base_logits.contiguous()}, args.out)

    lc = model.peft_config[ADAPTER]
    diff = (logits - base_logits).abs().max().item()
    print(f"peft_reference: {len(modules)} lora modules, {len(file_sd)} tensors, r={lc.r}, alpha={lc.lora_alpha}, "
          f"rslora={lc.use_rslora}, logits {tuple(logits.shape)}, max|adapter - base| = {diff:.3e} "
          f"(peft {peft.__version__}, transformers {transformers.__version__}, torch {torch.__version__})")
    print(f"peft_reference: OK: wrote {args.out}")


def cmd_make_adapter(args):
    base = load_base(args.base_dir)
    targets = args.targets if args.targets == "all-linear" else [t for t in args.targets.split(",") if t]
    config = LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=targets, bias="none",
                        task_type="CAUSAL_LM", init_lora_weights=False)
    torch.manual_seed(args.seed)
    model = get_peft_model(base, config, adapter_name=ADAPTER)
    modules = lora_modules(model)
    if not modules:
        fail(f"target_modules {targets!r} matched no module of {args.base_dir}")
    model.save_pretrained(args.out_dir, safe_serialization=True)
    n = sum(p.numel() for n_, p in model.named_parameters() if "lora_" in n_)
    print(f"peft_reference: {len(modules)} lora modules, {n} adapter parameters, r={args.rank}, alpha={args.alpha}, "
          f"targets={targets!r}, seed={args.seed}")
    print(f"peft_reference: OK: wrote {args.out_dir}")


def number(text):
    """An int when integral (PEFT's lora_alpha is an int; adapter_config.json then says 16, not 16.0)."""
    x = float(text)
    return int(x) if x.is_integer() else x


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    lg = sub.add_parser("logits", help="logits with and without a PEFT LoRA adapter")
    lg.add_argument("base_dir")
    lg.add_argument("adapter_dir")
    lg.add_argument("inputs")
    lg.add_argument("out")
    mk = sub.add_parser("make-adapter", help="a random PEFT LoRA adapter (B nonzero) for a base checkpoint")
    mk.add_argument("base_dir")
    mk.add_argument("out_dir")
    mk.add_argument("--rank", type=int, required=True)
    mk.add_argument("--alpha", type=number, required=True)
    mk.add_argument("--targets", default="all-linear", help="all-linear, or a comma-separated list of module names")
    mk.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    (cmd_logits if args.cmd == "logits" else cmd_make_adapter)(args)


if __name__ == "__main__":
    main()
