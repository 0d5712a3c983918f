"""This machine's memory bandwidth, measured by the streaming loop in stream.c on 1 thread and on all.

Depthwise convolution does a few multiply-adds per value it reads and writes, so memory, not the
FMA units, is its limit: the bench reports its depthwise rows in GB/s against this figure. The loop
(b = s·a over two arrays of 128 MiB each) is compiled with the compiler convgen uses and loaded with
cffi's ABI mode; bytes moved count each array once (read a, write b), as the bench counts a layer's
arrays. The bandwidth is the best of many passes, as bench/peak.py keeps the best FMA rate.
"""

from __future__ import annotations

import time
from pathlib import Path

from peak import load_loop

SOURCE = Path(__file__).resolve().parent / "stream.c"
CDEF = """
int stream_alloc(int64_t n, int threads);
void stream_free(void);
double stream_bytes(void);
float stream_scale(int threads, float s);
"""


class BandwidthMeter:
    """The streaming loop, compiled once over two arrays of `mib` MiB each; sample() times passes again,
    and the best rates seen so far are the bandwidth."""

    def __init__(self, threads: int, mib: int = 128):
        self.threads = threads
        self._dir, self._ffi, self._lib = load_loop(SOURCE, CDEF, "-O3", "the streaming loop")
        if not self._lib.stream_alloc(mib << 18, threads):  # mib MiB of 4-byte floats
            raise MemoryError(f"the streaming loop could not allocate 2 × {mib} MiB")
        self.best = {1: 0.0, threads: 0.0}
        self.samples = 0

    def sample(self, repeat: int = 1) -> None:
        """Stream the arrays `repeat` times on 1 thread and on all threads, keeping the best rates."""
        for _ in range(repeat):
            for n_threads in self.best:
                start = time.perf_counter()
                self._lib.stream_scale(n_threads, 1.0001)
                elapsed = time.perf_counter() - start
                self.best[n_threads] = max(self.best[n_threads], self._lib.stream_bytes() / elapsed / 1e9)
            self.samples += 1

    def result(self) -> dict:
        """{"threads", "gbs_1", "gbs_all", "samples"}: the best GB/s seen (10^9 bytes per second)."""
        return {"threads": self.threads, "gbs_1": self.best[1], "gbs_all": self.best[self.threads],
                "samples": self.samples}

    def close(self) -> None:
        self._lib.stream_free()
        self._dir.cleanup()


if __name__ == "__main__":
    import os
    meter = BandwidthMeter(len(os.sched_getaffinity(0)))
    meter.sample(10)
    print(meter.result())
    meter.close()
