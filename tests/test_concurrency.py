"""Kernels called from many threads at once, and one new kernel built by many processes at once.

Threads: the kernels release the GIL, so 8 Python threads really run C at the same time; every
result must be bit-for-bit the serial one (same thread count per call, same sums in the same order).
Processes: 8 interpreters ask an empty cache for the same never-built spec at the same moment; the
inter-process lock must let exactly one compile it while the others wait, and all must succeed
with identical results.
"""

import concurrent.futures
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

import convgen
from convgen.runtime import kernels
from convgen import reference
from convgen.planning.spec import Window
from grid import FORWARD_WINDOWS, GRADIENT_WINDOWS

ROOT = Path(__file__).resolve().parent.parent
THREADS = 8


def _tasks():
    """Calls of every op, layout, dtype and variant, large enough that C time dominates."""
    rng = np.random.default_rng(2024)
    tasks = []
    windows = [FORWARD_WINDOWS[4], FORWARD_WINDOWS[5], GRADIENT_WINDOWS[0], GRADIENT_WINDOWS[3]]
    for i, window in enumerate(windows):
        for layout in ("NCHW", "NHWC"):
            dtype = (np.float32, np.float64)[i % 2]
            kw = dict(stride=window.stride, padding=window.padding, dilation=window.dilation, layout=layout,
                      specialize=layout == "NCHW" or i % 2 == 0)
            x = rng.standard_normal((3, 16, 21, 19)).astype(dtype)
            w = rng.standard_normal((24, 16, *window.kernel)).astype(dtype)
            out_hw = window.output_size((21, 19))
            dy = rng.standard_normal((3, 24, *out_hw)).astype(dtype)
            if layout == "NHWC":
                x, dy = (np.ascontiguousarray(a.transpose(0, 2, 3, 1)) for a in (x, dy))
                w = np.ascontiguousarray(w.transpose(2, 3, 1, 0))
            # the transposed convolution from dy's size back to x's: w read as (C_in, C_out, KH, KW)
            remainder = [(n + sum(p) - e) % s for n, p, e, s in
                         zip((21, 19), window.padding, window.effective_kernel, window.stride)]
            kw_t = dict(kw, output_padding=tuple(remainder))
            tasks += [(convgen.conv2d, (x, w), kw), (convgen.conv2d_backward, (dy, x, w), kw),
                      (convgen.conv_transpose2d, (dy, w), kw_t), (convgen.conv_transpose2d_backward, (x, dy, w), kw_t)]
    return tasks


def _run(task):
    op, args, kw = task
    result = op(*args, **kw)
    return result if isinstance(result, tuple) else (result,)


def test_threads_calling_kernels_at_once_match_serial(monkeypatch):
    tasks = _tasks()
    serial = [_run(task) for task in tasks]
    # Every thread must also find its modules afresh: first loads race through the same lock.
    kernels.reset()
    start = threading.Barrier(THREADS)

    def worker(offset):
        start.wait()
        # each thread runs every task, starting at a different one, three times over
        return [(index, _run(tasks[index]))
                for _ in range(3) for index in (np.arange(len(tasks)) + offset) % len(tasks)]

    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        outcomes = list(pool.map(worker, range(THREADS)))
    assert sum(len(o) for o in outcomes) == THREADS * 3 * len(tasks)
    for outcome in outcomes:
        for index, results in outcome:
            for got, expected in zip(results, serial[index]):
                assert got.dtype == expected.dtype and np.array_equal(got, expected), \
                    f"task {index} ({tasks[index][0].__name__}) differs from its serial result"


# ------------------------------------------------------------------------------------ processes
# A window no other test builds, so the cache below really is empty of it.
FRESH_WINDOW = Window((2, 5), (3, 2), ((1, 0), (2, 1)), (2, 1))
PROCESSES = 8

CHILD = r"""
import hashlib, json, os, sys, time
from pathlib import Path
import numpy as np
import convgen
from convgen.planning.spec import ConvSpec, Window

spec = ConvSpec(Window((2, 5), (3, 2), ((1, 0), (2, 1)), (2, 1)), "float64", "NCHW")
convgen.runtime.kernels.settings()  # compiler checks done before the start line
Path(sys.argv[1], "ready-" + sys.argv[2]).touch()
while not Path(sys.argv[1], "go").exists():
    time.sleep(0.005)
outcome = convgen.build_all([spec], jobs=1, ops=("fwd",))[spec]  # one module, wanted by every process
if isinstance(outcome, Exception):
    raise outcome
rng = np.random.default_rng(7)
x, w = rng.standard_normal((2, 3, 11, 13)), rng.standard_normal((4, 3, 2, 5))
y = convgen.conv2d(x, w, stride=(3, 2), padding=((1, 0), (2, 1)), dilation=(2, 1))
print(json.dumps({"outcome": outcome, "digest": hashlib.sha256(y.tobytes()).hexdigest(), "shape": y.shape}))
"""


def test_processes_building_one_new_spec_at_once(tmp_path, monkeypatch):
    from grid import all_specs
    assert all(spec.window != FRESH_WINDOW for spec in all_specs()), "FRESH_WINDOW must be unique to this test"
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    env = dict(os.environ, CONVGEN_CACHE_DIR=str(cache),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    children = [subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(i)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for i in range(PROCESSES)]
    try:
        deadline = time.monotonic() + 300
        while len(list(tmp_path.glob("ready-*"))) < PROCESSES:
            assert all(child.poll() is None for child in children), "a child died before the start line"
            assert time.monotonic() < deadline, "children did not reach the start line"
            time.sleep(0.01)
        (tmp_path / "go").touch()
        outputs = [child.communicate(timeout=600) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    for child, (out, err) in zip(children, outputs):
        assert child.returncode == 0, f"child failed:\n{err}"
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert sorted(r["outcome"] for r in results) == ["built"] + ["cached"] * (PROCESSES - 1)
    assert len({r["digest"] for r in results}) == 1

    rng = np.random.default_rng(7)
    x, w = rng.standard_normal((2, 3, 11, 13)), rng.standard_normal((4, 3, 2, 5))
    expected = reference.conv2d(x, w, stride=(3, 2), padding=((1, 0), (2, 1)), dilation=(2, 1))
    assert list(results[0]["shape"]) == list(expected.shape)
    # the children's result, recomputed here from the module they built, matches the reference
    monkeypatch.setenv("CONVGEN_CACHE_DIR", str(cache))
    kernels.reset()
    with convgen.configure(modules="per-op"):  # the forward module the children built, not a new one of every op
        y = convgen.conv2d(x, w, stride=(3, 2), padding=((1, 0), (2, 1)), dilation=(2, 1))
    assert hashlib.sha256(y.tobytes()).hexdigest() == results[0]["digest"]
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)
    modules = [p.name for p in cache.iterdir() if p.suffix == ".so"]
    leftovers = [p.name for p in cache.iterdir() if p.name.endswith(".build")]
    assert len(modules) == 1 and leftovers == []
