#!/usr/bin/env python3
"""Summarise a libtorch (kineto) Chrome trace written with VERL_TRACE_DIR (see the README).

    python3 bench/trace_summary.py TRACE.json [--top 40]

Prints the GPU time per kernel name (total, share, count, mean), the span from the first kernel to the
end of the last, and the time the GPU sat idle between kernels (gaps over 10 us, by size): a phase whose
idle time is a large share of its span is waiting for the host to issue work. With `--by-op N` (a trace
recorded with VERL_TRACE_CPU=1) also the N largest (kernel, aten op that launched it, autograd node around
it) groups. With `--gap-ops N` the N longest idle gaps and the host events overlapping each. Standard library
only.
"""
import argparse
import bisect
import collections
import json
import re


def load(path):
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    cats = ("kernel", "gpu_memcpy", "gpu_memset")
    out = [e for e in events if e.get("ph") == "X" and e.get("cat") in cats]
    out.sort(key=lambda e: e["ts"])
    return events, out


def launchers(events):
    """correlation id -> (innermost aten op, enclosing autograd node) of each CUDA runtime call: one
    sweep per host thread over its (properly nested) cpu_op intervals."""
    ops = collections.defaultdict(list)
    calls = collections.defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") == "cpu_op":
            ops[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
        elif e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            calls[e["tid"]].append((e["ts"], e["args"]["correlation"]))
    owner = {}
    for tid, cl in calls.items():
        ol = sorted(ops.get(tid, []))
        stack, i = [], 0
        for t, corr in sorted(cl):
            while i < len(ol) and ol[i][0] <= t:
                while stack and stack[-1][1] < ol[i][0]:
                    stack.pop()
                stack.append(ol[i])
                i += 1
            while stack and stack[-1][1] < t:
                stack.pop()
            inner = stack[-1][2] if stack else "?"
            node = next((o[2].split(": ", 1)[-1] for o in reversed(stack)
                         if o[2].startswith("autograd::engine::evaluate_function")), "")
            owner[corr] = (inner, node)
    return owner


def short(name):
    # Template arguments make kernel names unreadable; keep the leading part.
    return re.sub(r"<.*", "<..>", name)[:100] if len(name) > 100 else name


def node_name(name):
    # A custom autograd function's node reads `torch::autograd::CppNode<(anonymous namespace)::XFn>`:
    # keep the function's name, which the truncation would cut.
    return re.sub(r"torch::autograd::CppNode<(?:\(anonymous namespace\)::)?(.*)>$", r"CppNode<\1>", name)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--by-op", type=int, default=0,
                    help="also list the N largest (kernel, launching aten op, autograd node) groups "
                         "(needs a trace recorded with VERL_TRACE_CPU=1)")
    ap.add_argument("--gaps", type=int, default=0,
                    help="also list the N kernel pairs (before -> after) with the most idle time between them")
    ap.add_argument("--gap-ops", type=int, default=0,
                    help="also list the N longest single idle gaps with the host events (CUDA runtime calls; "
                         "aten ops with VERL_TRACE_CPU=1) that overlap each, longest overlap first")
    a = ap.parse_args()
    events, ks = load(a.trace)
    if not ks:
        raise SystemExit(f"{a.trace}: no GPU kernels in the trace")
    per = collections.defaultdict(lambda: [0, 0.0])
    for e in ks:
        p = per[short(e["name"])]
        p[0] += 1
        p[1] += e["dur"]
    total = sum(v[1] for v in per.values())
    start, end = ks[0]["ts"], ks[0]["ts"] + ks[0]["dur"]
    gaps = collections.Counter()
    pairs = collections.defaultdict(lambda: [0, 0.0])
    prev = ks[0]
    singles, idle_spans = [], []
    for e in ks[1:]:
        g = e["ts"] - end
        if g > 50:
            idle_spans.append((end, end + g))
        if g > 200:
            singles.append((g, end, short(prev["name"])[:40], short(e["name"])[:40]))
        if g > 10:
            pair = pairs[(short(prev["name"])[:50], short(e["name"])[:50])]
            pair[0] += 1
            pair[1] += g
            bucket = ("10-50 us" if g < 50 else "50-200 us" if g < 200 else "0.2-1 ms" if g < 1000
                      else "1-5 ms" if g < 5000 else "> 5 ms")
            gaps[bucket] += g
        if e["ts"] + e["dur"] > end:
            end, prev = e["ts"] + e["dur"], e
    span = end - start
    idle = sum(gaps.values())
    print(f"{a.trace}: {len(ks)} GPU events, kernel time {total / 1e3:.1f} ms, span {span / 1e3:.1f} ms, "
          f"idle {idle / 1e3:.1f} ms ({100 * idle / span:.0f}% of the span)")
    print("idle by gap size (ms): " + ", ".join(f"{k} {v / 1e3:.1f}" for k, v in sorted(gaps.items())))
    print(f"{'ms':>10} {'share':>6} {'count':>7} {'mean us':>9}  kernel")
    for name, (n, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[: a.top]:
        print(f"{t / 1e3:10.2f} {100 * t / total:5.1f}% {n:7d} {t / n:9.1f}  {name}")
    if a.by_op:
        owner = launchers(events)
        groups = collections.defaultdict(lambda: [0, 0.0])
        for e in ks:
            op, node = owner.get(e.get("args", {}).get("correlation"), ("?", ""))
            g = groups[(short(e["name"])[:45], node_name(op)[:40], node_name(node)[:40])]
            g[0] += 1
            g[1] += e["dur"]
        print(f"{'ms':>10} {'count':>7}  kernel | aten op | autograd node")
        for (k, op, node), (n, t) in sorted(groups.items(), key=lambda kv: -kv[1][1])[: a.by_op]:
            print(f"{t / 1e3:10.2f} {n:7d}  {k} | {op} | {node}")
    if a.gaps:
        print(f"idle between kernels (gaps over 10 us): {'ms':>8} {'count':>6}  before -> after")
        for (b, f), (n, t) in sorted(pairs.items(), key=lambda kv: -kv[1][1])[: a.gaps]:
            print(f"{t / 1e3:48.2f} {n:6d}  {b} -> {f}")
    if a.gap_ops:
        host_cats = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")
        host = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                if e.get("ph") == "X" and e.get("cat") in host_cats and e.get("dur", 0) >= 20]
        # Over every gap above 50 us: which host events the GPU sat waiting through (innermost
        # names repeat their parents' time; read it as "inside which calls").
        total = collections.Counter()
        ends = [g1 for _, g1 in idle_spans]  # the gaps are disjoint and in order
        for t0, t1, name in host:
            k = bisect.bisect_right(ends, t0)
            while k < len(idle_spans) and idle_spans[k][0] < t1:
                g0, g1 = idle_spans[k]
                total[short(name)[:60]] += min(t1, g1) - max(t0, g0)
                k += 1
        print(f"host events inside the {len(idle_spans)} idle gaps over 50 us "
              f"({sum(b - a for a, b in idle_spans) / 1e3:.1f} ms), overlap ms:")
        for name, o in total.most_common(2 * a.gap_ops):
            print(f"  {o / 1e3:10.2f}  {name}")
        print("longest idle gaps (ms from the first kernel): host events overlapping each (overlap ms)")
        for g, g0, b, f in sorted(singles, reverse=True)[: a.gap_ops]:
            g1 = g0 + g
            over = collections.Counter()
            for t0, t1, name in host:
                o = min(t1, g1) - max(t0, g0)
                if o > 0:
                    over[short(name)[:60]] += o
            print(f"  {g / 1e3:8.2f} ms at {(g0 - start) / 1e3:9.2f}: {b} -> {f}")
            for name, o in over.most_common(6):
                print(f"  {'':>8}    {o / 1e3:8.2f}  {name}")


if __name__ == "__main__":
    main()
