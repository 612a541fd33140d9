#!/usr/bin/env python3
"""Summarise a libtorch (kineto) Chrome trace written with VERL_TRACE_DIR (see the README).

    python3 bench/trace_summary.py TRACE.json [--top 40]

Prints the GPU time per kernel name (total, share, count, mean), the span from the first kernel to the
end of the last, and the time the GPU sat idle between kernels (gaps over 10 us, by size): a phase whose
idle time is a large share of its span is waiting for the host to issue work. Standard library only.
"""
import argparse
import collections
import json
import re


def kernels(path):
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    cats = ("kernel", "gpu_memcpy", "gpu_memset")
    out = [e for e in events if e.get("ph") == "X" and e.get("cat") in cats]
    out.sort(key=lambda e: e["ts"])
    return out


def short(name):
    # Template arguments make kernel names unreadable; keep the leading part.
    return re.sub(r"<.*", "<..>", name)[:100] if len(name) > 100 else name


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--gaps", type=int, default=0,
                    help="also list the N kernel pairs (before -> after) with the most idle time between them")
    a = ap.parse_args()
    ks = kernels(a.trace)
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
    for e in ks[1:]:
        g = e["ts"] - end
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
    if a.gaps:
        print(f"idle between kernels (gaps over 10 us): {'ms':>8} {'count':>6}  before -> after")
        for (b, f), (n, t) in sorted(pairs.items(), key=lambda kv: -kv[1][1])[: a.gaps]:
            print(f"{t / 1e3:48.2f} {n:6d}  {b} -> {f}")


if __name__ == "__main__":
    main()
