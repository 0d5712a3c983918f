"""This machine's CPU model, and its float32 FMA peak measured by the loop in fma_peak.c on 1 thread
and on all threads.

The loop is compiled with the same compiler convgen uses (-march=native, OpenMP) into a temporary
directory and loaded with cffi's ABI mode; the peak is the best of many timed calls, since the
ceiling is what the hardware can do when nothing else gets in the way.
"""

from __future__ import annotations

import platform
import subprocess
import tempfile
import time
from pathlib import Path

import cffi

from convgen.runtime.toolchain import find_compiler

SOURCE = Path(__file__).resolve().parent / "fma_peak.c"


def cpu_model() -> str:
    """The CPU's model name as Linux reports it (/proc/cpuinfo), with its family and model numbers (a
    virtual machine may name only the brand: "AMD EPYC" is Zen 3 as family 25 model 1, Zen 4 as family
    25 model 17); else what the platform module knows."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = line.partition(":")
                if not line.strip():
                    break  # the first processor's fields
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    if "model name" not in fields:
        return platform.processor() or platform.machine()
    numbers = [f"{name} {fields[key]}" for name, key in (("family", "cpu family"), ("model", "model")) if key in fields]
    return f"{fields['model name']} ({', '.join(numbers)})" if numbers else fields["model name"]


def load_loop(source: Path, cdef: str, optimization: str, what: str):
    """Compile one of the bench's measuring loops (a C file beside this one) into a temporary
    directory and open it: (the directory, to keep alive while the library is used, ffi, lib)."""
    directory = tempfile.TemporaryDirectory(prefix=f"convgen-{source.stem}-")
    library = Path(directory.name) / f"{source.stem}.so"
    command = [find_compiler(), optimization, "-march=native", "-fopenmp", "-fPIC", "-shared", str(source),
               "-o", str(library)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"compiling {what} failed:\n$ {' '.join(command)}\n{result.stderr}")
    ffi = cffi.FFI()
    ffi.cdef(cdef)
    return directory, ffi, ffi.dlopen(str(library))
CDEF = """
const char *fma_isa(void);
double fma_flops_per_thread(int64_t iters);
double fma_loop(int threads, int64_t iters);
"""


class PeakMeter:
    """The FMA loop, compiled once; sample() times it again, and the best rates seen so far are the peak.

    On a shared machine a sample can land while another process holds a core, so the bench samples
    at the start, between rows and at the end, and keeps the best.
    """

    def __init__(self, threads: int, seconds: float = 0.1):
        self.threads, self.seconds = threads, seconds
        self._dir, self._ffi, self._lib = load_loop(SOURCE, CDEF, "-O2", "the FMA peak loop")
        self.isa = self._ffi.string(self._lib.fma_isa()).decode()
        self.best = {1: 0.0, threads: 0.0}
        self.samples = 0
        self._iters = {n: self._calibrate(n) for n in self.best}

    def _calibrate(self, n_threads: int) -> int:
        """Loop rounds that make one call last about `seconds`."""
        iters = 1 << 14
        while True:
            start = time.perf_counter()
            self._lib.fma_loop(n_threads, iters)
            elapsed = time.perf_counter() - start
            if elapsed >= self.seconds / 4:
                return max(1, int(iters * self.seconds / elapsed))
            iters *= 2

    def sample(self, repeat: int = 1) -> None:
        """Time the loop `repeat` times on 1 thread and on all threads, keeping the best rates."""
        for _ in range(repeat):
            for n_threads, iters in self._iters.items():
                start = time.perf_counter()
                self._lib.fma_loop(n_threads, iters)
                elapsed = time.perf_counter() - start
                rate = self._lib.fma_flops_per_thread(iters) * n_threads / elapsed / 1e9
                self.best[n_threads] = max(self.best[n_threads], rate)
            self.samples += 1

    def result(self) -> dict:
        """{"isa", "threads", "gflops_1", "gflops_all", "samples"}: the best GFLOP/s seen."""
        return {"isa": self.isa, "threads": self.threads, "gflops_1": self.best[1],
                "gflops_all": self.best[self.threads], "samples": self.samples}

    def close(self) -> None:
        self._dir.cleanup()


if __name__ == "__main__":
    import os
    meter = PeakMeter(len(os.sched_getaffinity(0)))
    meter.sample(10)
    print(meter.result())
    meter.close()
