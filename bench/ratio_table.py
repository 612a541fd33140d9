#!/usr/bin/env python3
"""Print a phase table and speed-ups from JSON lines (bench/trl_grpo.py output, and any other system's JSON that
uses the same keys: system, gen, old_log_prob, ref, update, step, tokens_per_s, peak_mem_gb).

"tensor GiB" is the peak memory held by tensors (torch.cuda.max_memory_allocated: trl_grpo.py's
peak_mem_gb, verl-rs's peak_tensor_mem_gb); "device GiB" is verl-rs's device-wide reading (cuMemGetInfo
total - free after each phase: the caching allocator's reserve and the KV pool included).

    python3 bench/ratio_table.py results.jsonl [more.jsonl ...] [--base verl-rs]

For every system other than --base (default: the first system seen), the speed-up row is
other_time / base_time per phase: > 1 means the base system is that many times faster. When a file holds several
lines for one system, the last one counts.
"""

import argparse
import json
import sys

PHASES = ["gen", "old_log_prob", "ref", "update", "step"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("files", nargs="+")
    p.add_argument("--base", default=None, help="system whose speed-up over the others is shown")
    a = p.parse_args()
    runs: dict[str, dict] = {}
    for path in a.files:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    r = json.loads(line)
                    runs[str(r.get("system", path))] = r
    if not runs:
        sys.exit("no JSON lines found")
    base = a.base or next(iter(runs))
    if base not in runs:
        sys.exit(f"--base {base}: not among {sorted(runs)}")

    def cell(v, fmt="{:.3f}"):
        return "-" if v is None else fmt.format(v)

    head = ["system"] + [f"{k} s" for k in PHASES] + ["tok/s", "tensor GiB", "device GiB"]
    rows = []

    def tensor_peak(r):
        # verl-rs reports both readings; other systems' peak_mem_gb is max_memory_allocated.
        if "peak_tensor_mem_gb" in r:
            return r["peak_tensor_mem_gb"]
        return None if "peak_mem_source" in r else r.get("peak_mem_gb")

    for name, r in runs.items():
        device = r.get("peak_mem_gb") if "peak_mem_source" in r else None
        rows.append([name] + [cell(r.get(k)) for k in PHASES]
                    + [cell(r.get("tokens_per_s"), "{:.0f}"), cell(tensor_peak(r), "{:.1f}"),
                       cell(device, "{:.1f}")])
    for name, r in runs.items():
        if name == base:
            continue
        sp = []
        for k in PHASES:
            b, o = runs[base].get(k), r.get(k)
            if o == 0 or b == 0:
                sp.append("skipped" if (o == 0) != (b == 0) else "-")  # one side does not run this phase
            else:
                sp.append("-" if b is None or o is None else f"{o / b:.2f}x")
        rows.append([f"{name} / {base}"] + sp + ["", "", ""])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    first = next(iter(runs.values()))
    print(f"arch={first.get('arch')} prompts={first.get('prompts')} n={first.get('n')} "
          f"prompt_len={first.get('prompt_len')} response_len={first.get('response_len')}")
    for row in [head] + rows:
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))


if __name__ == "__main__":
    main()
