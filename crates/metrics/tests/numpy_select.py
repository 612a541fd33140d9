"""NumPy's answers for tests/generations.rs: what `RandomState(42)` draws and how it shuffles.

usage: python numpy_select.py < request.json

The request is {"cases": [{"samples": [[input, output, score], ...], "n": int}], "draws": int}. For each case the
samples are sorted by input (Python's stable string sort), shuffled in place by `RandomState(42).shuffle` and
cut to the first n: the selection `trainer.log_val_generations` makes. Prints one JSON object:
    {"selections": [[[input, output, score], ...], ...],
     "raw32": [first `draws` outputs of RandomState(42)'s MT19937],
     "bounded40": [first `draws` of RandomState(42).randint(0, 2**40, dtype=int64)]}   # the 64-bit masked draw
"""

import json
import sys

import numpy as np


def select(samples, n):
    samples = [tuple(s) for s in samples]
    samples.sort(key=lambda s: s[0])
    np.random.RandomState(42).shuffle(samples)
    return samples[:n]


def main():
    request = json.load(sys.stdin)
    draws = request["draws"]
    out = {
        "selections": [select(case["samples"], case["n"]) for case in request["cases"]],
        "raw32": [int(x) for x in np.random.RandomState(42)._bit_generator.random_raw(draws)],
        "bounded40": [int(x) for x in np.random.RandomState(42).randint(0, 2**40, size=draws, dtype=np.int64)],
    }
    json.dump(out, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
