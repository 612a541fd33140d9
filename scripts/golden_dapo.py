"""Golden cases for the DAPO reward manager's overlong penalty, computed by verl's own code.

    python scripts/golden_dapo.py VERL_SRC OUT.json

VERL_SRC is the root of verl's sources (e.g. the unpacked `pip download verl==0.9.1 --no-deps`
wheel). The script loads verl's `reward_loop/reward_manager/{base,dapo}.py` unchanged. It stubs the
modules they import that need Ray, tensordict or omegaconf: `verl.DataProto` is only a type
annotation, the event loop is asyncio's, and the config is attribute access over dicts. It then runs
`DAPORewardManager.run_single` on one-row batches: several overlong-buffer settings, response lengths
on both sides of the buffer, and float and dict results of `compute_score`.
"""

import asyncio
import importlib.util
import json
import os
import sys
import types

import torch


class Cfg(dict):
    def __getattr__(self, k):
        return self[k]


def cfg(x):
    if isinstance(x, dict):
        return Cfg({k: cfg(v) for k, v in x.items()})
    return x


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


class Item:
    def __init__(self, responses, attention_mask, data_source, ground_truth):
        self.batch = {"responses": responses, "attention_mask": attention_mask}
        self.non_tensor_batch = {"data_source": data_source, "reward_model": {"ground_truth": ground_truth}, "extra_info": {}}


class Data:
    def __init__(self, item):
        self.item = item

    def __getitem__(self, k):
        return self if isinstance(k, slice) else self.item


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)


def main():
    src, out = sys.argv[1], sys.argv[2]
    stub("omegaconf", DictConfig=dict)
    stub("verl", DataProto=object)
    stub("verl.utils")
    stub("verl.utils.ray_utils", get_event_loop=asyncio.new_event_loop)
    stub("verl.utils.reward_score", default_compute_score=None)
    rm = os.path.join(src, "verl", "experimental", "reward_loop", "reward_manager")
    pkg = stub("verl.experimental.reward_loop.reward_manager", register=lambda name: (lambda c: c))
    pkg.__path__ = [rm]
    load("verl.experimental.reward_loop.reward_manager.base", os.path.join(rm, "base.py"))
    dapo = load("verl.experimental.reward_loop.reward_manager.dapo", os.path.join(rm, "dapo.py"))

    def score_float(data_source, solution_str, ground_truth, extra_info):
        return float(len(solution_str.split()) % 3) / 2.0

    def score_dict(data_source, solution_str, ground_truth, extra_info):
        n = len(solution_str.split())
        return {"score": 1.0 if n % 2 else -1.0, "acc": float(n % 2), "pred": str(n)}

    settings = [
        dict(enable=True, len=4, penalty_factor=1.0, log=True),
        dict(enable=True, len=8, penalty_factor=0.5, log=False),
        dict(enable=True, len=16, penalty_factor=2.0, log=True),
        dict(enable=False, len=4, penalty_factor=1.0, log=True),
    ]
    cases = []
    for buf in settings:
        for max_resp_len in (16, 32):
            if buf["len"] > max_resp_len:
                continue
            for valid in (1, 5, max_resp_len - buf["len"], max_resp_len - buf["len"] + 1, max_resp_len - 1, max_resp_len):
                for fn in (score_float, score_dict):
                    config = cfg({"reward": {"reward_kwargs": {"overlong_buffer_cfg": buf, "max_resp_len": max_resp_len}}})
                    mgr = dapo.DAPORewardManager(config, Tok(), fn)
                    width = max_resp_len
                    responses = torch.arange(10, 10 + width)
                    mask = torch.cat([torch.ones(3, dtype=torch.long), (torch.arange(width) < valid).long()])
                    item = Item(responses, mask, "math_dapo", "7")
                    res = mgr.loop.run_until_complete(mgr.run_single(Data(item)))
                    base = fn("math_dapo", Tok().decode(responses[:valid]), "7", {})
                    extra = {}
                    for k, v in res["reward_extra_info"].items():
                        if isinstance(v, torch.Tensor):
                            v = v.item()
                        if isinstance(v, (bool, int, float)):
                            extra[k] = float(v)
                    reward = res["reward_score"]
                    cases.append({
                        "overlong_buffer_cfg": buf, "max_resp_len": max_resp_len, "valid_response_length": valid,
                        "score": base["score"] if isinstance(base, dict) else base,
                        "reward": float(reward.item() if isinstance(reward, torch.Tensor) else reward),
                        "extra": extra,
                    })
    with open(out, "w") as f:
        json.dump({"source": "verl 0.9.1 verl/experimental/reward_loop/reward_manager/dapo.py (DAPORewardManager.run_single)", "cases": cases}, f, indent=1)
    print(f"{len(cases)} cases -> {out}")


if __name__ == "__main__":
    main()
