"""Threads: CONVGEN_NUM_THREADS, every thread count giving the same result, and the GIL released in C."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import convgen
from convgen import reference
from helpers import assert_close

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _num_threads_in_subprocess(value):
    env = dict(os.environ, CONVGEN_NUM_THREADS=value, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", "import convgen; print(convgen.num_threads())"],
                          capture_output=True, text=True, env=env, timeout=120)


def test_environment_sets_the_thread_count():
    result = _num_threads_in_subprocess("3")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "3"


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_a_bad_environment_value_is_a_clear_error(value):
    result = _num_threads_in_subprocess(value)
    assert result.returncode != 0
    assert "CONVGEN_NUM_THREADS must be a positive integer" in result.stderr


def test_set_num_threads_checks_its_argument():
    for bad in (0, -1, 2.0, True, "2"):
        with pytest.raises(ValueError, match="num_threads must be a positive int"):
            convgen.set_num_threads(bad)


@pytest.fixture
def restore_threads():
    before = convgen.num_threads()
    yield
    convgen.set_num_threads(before)


def test_every_thread_count_gives_the_same_result(restore_threads):
    """Work is split differently for 1, 2, 3 and 5 threads; the sums must not change beyond rounding."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 12, 30, 26))
    w = rng.standard_normal((20, 12, 3, 3))
    dy = rng.standard_normal((3, 20, 15, 13))
    results = {}
    for threads in (1, 2, 3, 5):
        convgen.set_num_threads(threads)
        y = convgen.conv2d(x, w, stride=2, padding=1)
        dx, dw, db = convgen.conv2d_backward(dy, x, w, stride=2, padding=1)
        t = convgen.conv_transpose2d(dy, w, stride=2, padding=1, output_padding=1)
        results[threads] = (y, dx, dw, db, t)
    expected = (reference.conv2d(x, w, stride=2, padding=1),
                *reference.conv2d_backward(dy, x, w, stride=2, padding=1),
                reference.conv_transpose2d(dy, w, stride=2, padding=1, output_padding=1))
    for threads, arrays in results.items():
        for got, want in zip(arrays, expected):
            assert_close(got, want, np.float64, f"{threads} threads")


def test_the_gil_is_released_while_a_kernel_runs(restore_threads):
    """While one Python thread is inside a long kernel call, another keeps running Python code.

    With the GIL held through the call, the watcher could not run a single bytecode until the
    call returned; released, it loops for the whole call.
    """
    convgen.set_num_threads(1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 32, 64, 64)).astype(np.float32)
    w = rng.standard_normal((32, 32, 5, 5)).astype(np.float32)
    convgen.conv2d(x, w, padding=2)  # load the kernels first
    inside = threading.Event()
    finished = threading.Event()

    def worker():
        inside.set()
        convgen.conv2d(x, w, padding=2)  # about 1.7 GFLOP: tens of milliseconds or more
        finished.set()

    thread = threading.Thread(target=worker)
    thread.start()
    inside.wait()
    spins = 0
    while not finished.is_set():
        spins += 1
    thread.join()
    assert spins > 1000, f"the watcher ran only {spins} iterations while the kernel was running"
