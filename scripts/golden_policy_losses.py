"""Golden cases for the geo_mean, dppo_tv and dppo_kl policy losses, computed by verl's own code.

    python scripts/golden_policy_losses.py VERL_SRC OUT.json

VERL_SRC is the root of verl's sources (a checkout, or `git archive HEAD verl` of one). The script
loads verl's `verl/trainer/ppo/core_algos.py` and `verl/utils/torch_functional.py` unchanged, stubbing
what they import only for types or devices (omegaconf, tensordict, verl's config classes). The actor
config is attribute access over a dict with verl's `.get`. Each case runs the registered loss in
float64 on seeded inputs and records `pg_loss`, the three metrics and the gradient of the loss with
respect to `log_prob` (verl's autograd). The cases cover every `loss_agg_mode` (geo_mean ignores it),
asymmetric clip bounds, a truncation bound that bites, and rollout importance weights.
"""

import importlib.util
import json
import os
import sys
import types

import torch


class Cfg(dict):
    def __getattr__(self, k):
        return self[k]

    def get(self, k, default=None):
        return self[k] if k in self else default


def stub(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m
    return m


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m
    spec.loader.exec_module(m)
    return m


def verl_core_algos(src):
    stub("omegaconf", DictConfig=dict)
    stub("tensordict", TensorDict=object)
    stub("verl").__path__ = [os.path.join(src, "verl")]
    stub("verl.utils", as_torch_index=None, group_mean_std=None).__path__ = []
    stub("verl.utils.device", get_device_name=lambda: "cpu", get_torch_device=lambda: torch.cpu)
    stub("verl.utils.import_utils", deprecated=lambda *a, **k: (lambda f: f))
    stub("verl.trainer").__path__ = []
    stub("verl.trainer.config", AlgoConfig=type("AlgoConfig", (), {}))
    stub("verl.trainer.ppo").__path__ = []
    stub("verl.workers").__path__ = []
    stub("verl.workers.config", ActorConfig=Cfg)
    tf = load("verl.utils.torch_functional", os.path.join(src, "verl", "utils", "torch_functional.py"))
    sys.modules["verl.utils"].torch_functional = tf
    return load("verl.trainer.ppo.core_algos", os.path.join(src, "verl", "trainer", "ppo", "core_algos.py"))


def inputs(gen, rows, cols, spread, with_weights):
    old = -torch.rand(rows, cols, generator=gen, dtype=torch.float64) * 3.0 - 0.05
    lp = old + torch.randn(rows, cols, generator=gen, dtype=torch.float64) * spread
    lp = lp.clamp(max=-1e-3)
    # One sequence-level advantage per row, as GRPO gives (geo_mean assumes it), with mixed signs.
    adv = torch.randn(rows, 1, generator=gen, dtype=torch.float64).expand(rows, cols).clone()
    lengths = torch.randint(1, cols + 1, (rows,), generator=gen)
    mask = (torch.arange(cols)[None, :] < lengths[:, None]).to(torch.float64)
    weights = None
    if with_weights:
        weights = torch.rand(rows, cols, generator=gen, dtype=torch.float64) * 1.5 + 0.25
    return old, lp, adv, mask, weights


def main():
    src, out = sys.argv[1], sys.argv[2]
    core = verl_core_algos(src)
    gen = torch.Generator().manual_seed(0)
    cases = []
    settings = []
    for mode in ["geo_mean", "dppo_tv", "dppo_kl"]:
        for agg in ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]:
            settings.append((mode, agg, 0.2, 0.28, 3.0, 0.3, False))
        # A truncation bound that bites, tight bounds, symmetric bounds, wide spreads, importance weights.
        settings.append((mode, "token-mean", 0.1, 0.1, 1.2, 0.6, False))
        settings.append((mode, "token-mean", 0.02, 0.03, 3.0, 0.4, False))
        settings.append((mode, "token-mean", 0.4, 0.4, 10000.0, 0.05, True))
        settings.append((mode, "seq-mean-token-mean", 0.2, 0.27, 3.0, 0.3, True))
    for mode, agg, low, high, c, spread, with_weights in settings:
        old, lp, adv, mask, weights = inputs(gen, 6, 9, spread, with_weights)
        cfg = Cfg(clip_ratio=0.2, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c, global_batch_info={})
        x = lp.clone().requires_grad_(True)
        loss, metrics = core.get_policy_loss_fn(mode)(
            old_log_prob=old,
            log_prob=x,
            advantages=adv,
            response_mask=mask,
            loss_agg_mode=agg,
            config=cfg,
            rollout_is_weights=weights,
        )
        loss.backward()
        case_inputs = {
            "old_log_prob": old.tolist(),
            "log_prob": lp.tolist(),
            "advantages": adv.tolist(),
            "response_mask": mask.tolist(),
        }
        if weights is not None:
            case_inputs["rollout_is_weights"] = weights.tolist()
        cases.append(
            {
                "fn": "policy_loss",
                "params": {
                    "loss_mode": mode,
                    "loss_agg_mode": agg,
                    "clip_ratio_low": low,
                    "clip_ratio_high": high,
                    "clip_ratio_c": c,
                },
                "inputs": case_inputs,
                "outputs": {
                    "pg_loss": loss.item(),
                    "pg_clipfrac": metrics["actor/pg_clipfrac"],
                    "pg_clipfrac_lower": metrics["actor/pg_clipfrac_lower"],
                    "ppo_kl": metrics["actor/ppo_kl"],
                    "grad_log_prob": x.grad.tolist(),
                },
            }
        )
    doc = {
        "source": "verl verl/trainer/ppo/core_algos.py (geo_mean, dppo_tv, dppo_kl) and "
        "verl/utils/torch_functional.py, float64; scripts/golden_policy_losses.py",
        "cases": cases,
    }
    with open(out, "w") as f:
        # One case per line, so a regenerated file diffs case by case.
        f.write('{"source": %s, "cases": [\n' % json.dumps(doc["source"]))
        f.write(",\n".join(json.dumps(c) for c in cases))
        f.write("\n]}\n")
    print(f"{len(cases)} cases -> {out}")


if __name__ == "__main__":
    main()
