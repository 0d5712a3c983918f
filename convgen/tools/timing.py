"""Side-by-side timing: implementations alternate within one run and medians are compared.

Shared machines drift; alternating spreads any drift over all implementations alike, and the
median ignores the odd slow repeat.
"""

from __future__ import annotations

import statistics
import time


def time_alternating(funcs: dict, repeat: int = 7, warmup: int = 1, min_time: float = 0.02) -> dict:
    """Median seconds per call of each zero-argument callable in `funcs`.

    Each repeat calls every implementation in turn (rotating the order), as many times as makes one
    sample last about `min_time`, so fast calls are not lost in timer resolution.
    """
    names = list(funcs)
    loops = {}
    for name in names:
        for _ in range(warmup):
            funcs[name]()
        start = time.perf_counter()
        funcs[name]()
        once = max(time.perf_counter() - start, 1e-7)
        loops[name] = max(1, int(min_time / once))
    samples = {name: [] for name in names}
    for r in range(repeat):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            func, n = funcs[name], loops[name]
            start = time.perf_counter()
            for _ in range(n):
                func()
            samples[name].append((time.perf_counter() - start) / n)
    return {name: statistics.median(values) for name, values in samples.items()}
