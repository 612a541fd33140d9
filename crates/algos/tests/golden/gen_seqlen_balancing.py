"""Generates `seqlen_balancing.json`, the golden cases for `verl_algos::balance`, by running verl's own code.

Source: verl (github.com/verl-project/verl) at commit 1dda039b9c6311889a9c9a26040677e1254814f9
(version 0.10.0.dev), file `verl/utils/seqlen_balancing.py` (last changed in 80eb57ea, #5438). The only
code here that is not verl's is the six-line zigzag of `RayPPOTrainer._balance_batch`
(`verl/trainer/ppo/ray_trainer.py` at the same commit), reproduced in `balance_batch` below with the rest
of that method calling verl's functions exactly as it does.

verl's file is loaded as a single module from the path given on the command line. Its top-level imports
(`verl.protocol`, `verl.utils.tensordict_utils`, `verl.utils.device`) need the `verl` package importable,
so the package is exported from the same commit and put on PYTHONPATH; nothing is stubbed:

    git -C VERL_CLONE archive 1dda039b9c6311889a9c9a26040677e1254814f9 verl | tar -x -C /tmp/verl-src
    python3.11 -m venv /tmp/gen-venv     # generated with torch 2.11.0, tensordict 0.15.3, ray 2.60.0
    /tmp/gen-venv/bin/pip install torch tensordict ray omegaconf
    PYTHONPATH=/tmp/verl-src /tmp/gen-venv/bin/python gen_seqlen_balancing.py \
        /tmp/verl-src/verl/utils/seqlen_balancing.py \
        --verl-commit 1dda039b9c6311889a9c9a26040677e1254814f9 > seqlen_balancing.json

Output: `{"source": {...}, "cases": [...]}`. Each case has `fn` (the verl function, or `balance_batch` for
`_balance_batch`'s row order), `params`, `inputs` and either `outputs` or `raises` (the exception type verl
raised). Metric values are written as strings (Python's `str` of the int or float verl returned) so the
Rust side can parse them exactly: serde_json's default float parsing is not correctly rounded.
"""

import argparse
import hashlib
import importlib.util
import json
import random
import sys

import torch


def load_verl_module(path):
    spec = importlib.util.spec_from_file_location("verl_seqlen_balancing", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def metrics_out(metrics):
    return [[name, str(value)] for name, value in metrics.items()]


class Cases:
    def __init__(self, sb):
        self.sb = sb
        self.cases = []

    def add(self, fn_name, params, inputs, run):
        case = {"fn": fn_name, "params": params, "inputs": inputs}
        try:
            case["outputs"] = run()
        except (AssertionError, ValueError, IndexError) as e:
            case["raises"] = type(e).__name__
        self.cases.append(case)

    def workload(self, seqlens):
        def run():
            return {"workloads": self.sb.calculate_workload(torch.tensor(seqlens, dtype=torch.int64)).tolist()}

        self.add("calculate_workload", {}, {"seqlens": seqlens}, run)

    def kk(self, values, k, equal_size):
        def run():
            return {"partitions": self.sb.karmarkar_karp(values, k_partitions=k, equal_size=equal_size)}

        self.add("karmarkar_karp", {"k": k, "equal_size": equal_size}, {"values": values}, run)

    def balanced(self, values, k, equal_size):
        def run():
            return {
                "partitions": self.sb.get_seqlen_balanced_partitions(values, k_partitions=k, equal_size=equal_size)
            }

        self.add("get_seqlen_balanced_partitions", {"k": k, "equal_size": equal_size}, {"values": values}, run)

    def grouped(self, seqlens, uids, k):
        def run():
            return {"partitions": self.sb.get_group_balanced_partitions(seqlens, uids, k_partitions=k)}

        self.add("get_group_balanced_partitions", {"k": k}, {"seqlens": seqlens, "uids": uids}, run)

    def unbalance(self, seqlens, partitions, prefix):
        def run():
            return {"metrics": metrics_out(self.sb.log_seqlen_unbalance(seqlens, partitions, prefix=prefix))}

        self.add("log_seqlen_unbalance", {"prefix": prefix}, {"seqlens": seqlens, "partitions": partitions}, run)

    def balance_batch(self, seqlens, dp_size, uids=None):
        """`RayPPOTrainer._balance_batch` with `keep_minibatch=False`; `uids` set means `use_prefix_grouper`."""
        sb = self.sb

        def run():
            # attention_mask.sum(-1) of an int64 mask: an int64 tensor of per-row lengths.
            global_seqlen_lst = torch.tensor(seqlens, dtype=torch.int64)
            workload_lst = sb.calculate_workload(global_seqlen_lst)
            if uids is not None:
                # (ray_trainer first raises ValueError when the distinct uids are not divisible by dp_size; that
                # check is not reproduced here, so such a case shows the assertion verl's module raises instead.)
                partitions = sb.get_group_balanced_partitions(
                    seqlen_list=global_seqlen_lst.tolist(), uid_list=list(uids), k_partitions=dp_size
                )
            else:
                partitions = sb.get_seqlen_balanced_partitions(workload_lst, k_partitions=dp_size, equal_size=True)
                # The zigzag, as in ray_trainer.py (the only code not taken from verl's module).
                for idx, partition in enumerate(partitions):
                    partition.sort(key=lambda x: (workload_lst[x], x))
                    ordered_partition = partition[::2] + partition[1::2][::-1]
                    partitions[idx] = ordered_partition
            metrics = sb.log_seqlen_unbalance(
                seqlen_list=global_seqlen_lst.tolist(), partitions=partitions, prefix="global_seqlen"
            )
            return {"partitions": partitions, "metrics": metrics_out(metrics)}

        inputs = {"seqlens": seqlens}
        if uids is not None:
            inputs["uids"] = uids
        self.add("balance_batch", {"dp_size": dp_size}, inputs, run)


def random_lengths(rng, n, lo=1, hi=4096):
    return [rng.randint(lo, hi) for _ in range(n)]


def few_distinct(rng, n, choices):
    return [rng.choice(choices) for _ in range(n)]


def grouped_lengths(rng, groups, per_group, lo=16, hi=2048):
    """Rows of `groups` prompts, `per_group` samples each, uids contiguous as after `repeat(interleave=True)`."""
    seqlens = random_lengths(rng, groups * per_group, lo, hi)
    uids = [f"uid-{g}" for g in range(groups) for _ in range(per_group)]
    return seqlens, uids


def generate(sb):
    rng = random.Random(20260822)
    c = Cases(sb)

    # calculate_workload: int64 arithmetic, including the wrap past 2^63 that torch's int64 shares with Rust's.
    c.workload([0, 1, 2, 127, 4096, 32768, 131072, 1_000_000])
    c.workload([3_000_000_000, 3_100_000_000, 4_000_000_000])

    # karmarkar_karp's raw partitions: set order and item order within each set, before any sorting.
    c.kk([5, 3, 2, 7, 1, 1], 2, True)
    c.kk([5, 3, 2, 7, 1, 1], 3, False)
    c.kk([7] * 12, 4, True)
    c.kk([7] * 12, 3, False)
    c.kk(few_distinct(rng, 24, [10, 20, 30]), 4, True)
    c.kk(few_distinct(rng, 17, [1, 2]), 3, False)
    c.kk(random_lengths(rng, 40), 8, True)
    c.kk(random_lengths(rng, 33), 4, False)
    c.kk([0, 0, 0, 0], 2, False)
    c.kk([5, -3], 2, False)

    # get_seqlen_balanced_partitions across k, equal_size, ties and sizes.
    for k in (1, 2, 3, 4, 8):
        c.balanced(random_lengths(rng, k * 6), k, True)
        c.balanced(random_lengths(rng, k * 5 + 1), k, False)
    for k in (2, 4, 8):
        c.balanced([100] * (k * 4), k, True)
        c.balanced([100] * (k * 3 + 1), k, False)
        c.balanced(few_distinct(rng, k * 4, [64, 128, 256]), k, True)
    c.balanced([9, 1, 4], 3, True)  # len == k
    c.balanced([9, 1, 4, 4], 4, False)  # len == k
    c.balanced([1, 1, 1, 1, 1, 1, 1, 1], 8, True)
    c.balanced([3, 1, 2], 2, False)
    c.balanced([2, 1], 2, True)
    c.balanced(random_lengths(rng, 256, 1, 32768), 8, True)
    c.balanced(sb.calculate_workload(torch.tensor(random_lengths(rng, 64))).tolist(), 4, True)  # workload-sized
    # verl's assertions.
    c.balanced([1, 2, 3], 4, False)  # fewer items than partitions
    c.balanced([1, 2, 3, 4, 5], 2, True)  # not divisible
    c.balanced([5, -3], 2, False)  # an empty partition

    # get_group_balanced_partitions: groups of n = 2..8 samples, contiguous uids.
    for n, groups, k in ((2, 8, 2), (3, 6, 3), (4, 8, 4), (5, 4, 2), (6, 8, 8), (7, 3, 3), (8, 8, 4)):
        seqlens, uids = grouped_lengths(rng, groups, n)
        c.grouped(seqlens, uids, k)
    c.grouped([100] * 16, [f"u{i // 4}" for i in range(16)], 2)  # all ties
    c.grouped([5, 5, 1, 1, 9, 9], ["a", "a", "b", "b", "a", "a"], 3)  # a repeated uid, not contiguous
    c.grouped([5, 5, 1, 1], ["a", "a", "b", "b"], 4)  # fewer groups than partitions
    c.grouped([5, 5, 1, 1, 2, 2], ["a", "a", "b", "b", "c", "c"], 2)  # groups not divisible by k

    # log_seqlen_unbalance, including lengths not divisible by k (a short last chunk).
    c.unbalance([1, 2, 3, 4, 5, 6, 7, 8], [[0, 7], [1, 6], [2, 5], [3, 4]], "global_seqlen")
    c.unbalance([10, 1, 1, 1, 1, 10, 3], [[0, 1, 2], [3, 4, 5, 6]], "x")
    c.unbalance([7, 7, 7, 1, 2, 2, 9, 4, 4, 1], [[0, 3, 6], [1, 4, 7], [2, 5, 8, 9]], "p")
    c.unbalance([5, 5], [[0, 1], []], "empty_partition")
    c.unbalance([1], [[0], []], "too_few")

    # _balance_batch: the rank-major row order and the global_seqlen/* metrics.
    for dp in (1, 2, 3, 4, 8):
        c.balance_batch(random_lengths(rng, dp * 8, 8, 8192), dp)
    c.balance_batch([512] * 16, 4)
    c.balance_batch(few_distinct(rng, 32, [100, 200, 300, 400]), 8)
    c.balance_batch(random_lengths(rng, 128, 1, 16384), 4)
    for n, groups, dp in ((2, 8, 4), (4, 4, 2), (5, 6, 3), (8, 8, 8)):
        seqlens, uids = grouped_lengths(rng, groups, n)
        c.balance_batch(seqlens, dp, uids)
    c.balance_batch([100] * 12, 2, [f"u{i // 3}" for i in range(12)])
    c.balance_batch([5, 5, 1, 1, 2, 2], 2, ["a", "a", "b", "b", "c", "c"])  # 3 uid groups on 2 ranks
    return c.cases


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("seqlen_balancing_py", help="path to verl's verl/utils/seqlen_balancing.py")
    parser.add_argument("--verl-commit", required=True, help="the verl commit the file was exported from")
    args = parser.parse_args()
    with open(args.seqlen_balancing_py, "rb") as f:
        file_sha256 = hashlib.sha256(f.read()).hexdigest()
    sb = load_verl_module(args.seqlen_balancing_py)
    doc = {
        "source": {
            "repo": "verl-project/verl",
            "commit": args.verl_commit,
            "file": "verl/utils/seqlen_balancing.py",
            "file_sha256": file_sha256,
            "zigzag_from": "verl/trainer/ppo/ray_trainer.py RayPPOTrainer._balance_batch",
            "generator": "crates/algos/tests/golden/gen_seqlen_balancing.py",
            "torch": torch.__version__,
            "python": sys.version.split()[0],
        },
        "cases": generate(sb),
    }
    # One case per line, so a regenerated file diffs case by case.
    compact = {"separators": (",", ":")}
    sys.stdout.write('{"source":' + json.dumps(doc["source"], indent=1) + ',\n"cases":[\n')
    sys.stdout.write(",\n".join(json.dumps(case, **compact) for case in doc["cases"]))
    sys.stdout.write("\n]}\n")


if __name__ == "__main__":
    main()
