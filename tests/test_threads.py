"""Threads: CONVGEN_NUM_THREADS, every thread count giving the same result, and the GIL released in C."""

import ctypes
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import convgen
from convgen import reference
from convgen.planning.planner import VARIANTS
from convgen.planning.spec import Window
from helpers import assert_close, call_problem, kernels_for, planned_threads, seeded_rng

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


# ------------------------------------------------------------------------ the same result on any count
WINDOW = Window(3, 2, 1)
KW = dict(stride=2, padding=1)
OPS = ("conv2d", "conv2d_backward", "conv_transpose2d", "conv_transpose2d_backward")


def _arrays(layout):
    """About 32 MFLOP a call: the kernels' planner gives each thread at least 2 MFLOP, so up to 16 threads."""
    rng = seeded_rng("threads", layout)
    x = rng.standard_normal((3, 48, 30, 26))
    w = rng.standard_normal((64, 48, 3, 3))
    dy = rng.standard_normal((3, 64, 15, 13))
    if layout == "NHWC":
        x, w, dy = x.transpose(0, 2, 3, 1).copy(), w.transpose(2, 3, 1, 0).copy(), dy.transpose(0, 2, 3, 1).copy()
    return x, w, dy


def _all_ops(x, w, dy, layout, module):
    """Every op's results: conv2d of x, its gradients given dy, and the transposed pair run on dy
    (conv_transpose2d's input) with x-shaped gradients (output_padding 1 brings 15 × 13 back to 30 × 26)."""
    kw = dict(KW, layout=layout)
    return {
        "conv2d": (module.conv2d(x, w, **kw),),
        "conv2d_backward": module.conv2d_backward(dy, x, w, **kw),
        "conv_transpose2d": (module.conv_transpose2d(dy, w, output_padding=1, **kw),),
        "conv_transpose2d_backward": module.conv_transpose2d_backward(x, dy, w, output_padding=1, **kw),
    }


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_every_thread_count_gives_the_same_result(layout, threads):
    """Work is split differently for 1, 2, 3 and 5 threads (each planned, not capped to one); the
    sums must not change beyond rounding, and every op, dx and the transposed kernel included,
    matches the reference on each count."""
    x, w, dy = _arrays(layout)
    expected = _all_ops(x, w, dy, layout, reference)
    results = {}
    for count in (1, 2, 3, 5):
        threads(count)
        for op in OPS:  # the input and output of each op's call, for the planner's sizes
            inp, out = (x, dy) if not op.startswith("conv_transpose2d") else (dy, x)
            planned = planned_threads(op, inp, out, WINDOW, 1, layout)
            if count == 1:
                assert set(planned.values()) == {1}, f"{op}: {planned} on one thread"
            else:
                assert min(planned.values()) >= 2, f"{op}: only {planned} planned for {count} threads"
        results[count] = _all_ops(x, w, dy, layout, convgen)
    for count, arrays in results.items():
        for op in OPS:
            for got, one, want in zip(arrays[op], results[1][op], expected[op]):
                assert_close(got, one, np.float64, f"{op} on {count} threads against one thread")
                assert_close(got, want, np.float64, f"{op} on {count} threads against the reference")


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("channels, filters, size, image", [(128, 128, 3, 7), (64, 512, 1, 14)],
                         ids=["columns", "filters"])
def test_weight_gradient_of_one_small_image_uses_the_threads(layout, groups, channels, filters, size, image, threads):
    """Batch 1 with 7 × 7 outputs is one pixel block, with 14 × 14 two: too few for the threads to split
    the pixels. The weight gradient's threads split the (channel, tap) columns instead (128 channels ×
    3 × 3), or, with too few of them for the threads (64 channels, 1 × 1), the filters (NCHW sums
    straight into dw, NHWC through one shared gradient), on any thread count, and give the reference's
    result."""
    rng = seeded_rng("small image dw", layout, groups, size)
    x = rng.standard_normal((1, channels, image, image))
    w = rng.standard_normal((filters, channels // groups, size, size))
    dy = rng.standard_normal((1, filters, image, image))
    if layout == "NHWC":
        x, w, dy = x.transpose(0, 2, 3, 1).copy(), w.transpose(2, 3, 1, 0).copy(), dy.transpose(0, 2, 3, 1).copy()
    kw = dict(padding=size // 2, groups=groups, layout=layout)
    expected = reference.conv2d_backward(dy, x, w, **kw)[1]
    with convgen.configure(pixel_rows_nchw_dw_max_weights=0, **dict(VARIANTS["phase planes"])):  # (not the rows)
        for count in (1, 2, 3, 5):
            threads(count)
            planned = planned_threads("conv2d_backward", x, dy, Window(size, 1, size // 2), groups, layout,
                                      algorithm="direct")
            assert planned["bwd_weight"] >= min(count, 2), f"{planned} planned for {count} threads"
            dw = convgen.conv2d_backward(dy, x, w, algorithm="direct", **kw)[1]
            assert_close(dw, expected, np.float64, f"dw on {count} threads, groups={groups}, {layout}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_weight_gradient_summed_from_each_threads_gradient(dtype, threads):
    """An NCHW weight gradient through the phase planes whose threads split the pixels: each thread
    fills its own gradient, and their sum, added column by column into dweight, is the reference's
    (the pixel-row kernels are kept out by the schedule, so that the planes run on every ISA)."""
    rng = seeded_rng("per-thread gradients", np.dtype(dtype).name)
    x = rng.standard_normal((6, 40, 16, 16)).astype(dtype)
    w = rng.standard_normal((80, 40, 3, 3)).astype(dtype)
    dy = rng.standard_normal((6, 80, 16, 16)).astype(dtype)
    expected = reference.conv2d_backward(dy, x, w, padding=1)[1]
    threads(2)
    with convgen.configure(pixel_rows_nchw_dw_max_weights=0):
        planned = planned_threads("conv2d_backward", x, dy, Window(3, 1, 1), 1, "NCHW", algorithm="direct")
        assert planned["bwd_weight"] == 2, f"{planned} planned for 2 threads"
        dw = convgen.conv2d_backward(dy, x, w, padding=1, algorithm="direct")[1]
    assert_close(dw, expected, dtype, "dw summed from two threads' gradients")


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_weight_gradient_of_few_units_splits_the_columns(layout, dtype, threads):
    """8 images of 7 × 7 make four units of the phase planes' weight gradient, too few for a private
    gradient per thread (72 × 130 × 3 × 3 here): the work items own blocks of the (channel, tap) columns
    and sum straight into one gradient (in NCHW dw itself: 2 threads ask for twice the memory of one,
    not that and two private gradients); the reference's result on 1, 2 and 3 threads."""
    from convgen.frontend import ops

    rng = seeded_rng("dw column split", layout, np.dtype(dtype).name)
    x = rng.standard_normal((8, 130, 7, 7)).astype(dtype)
    w = rng.standard_normal((72, 130, 3, 3)).astype(dtype)
    dy = rng.standard_normal((8, 72, 7, 7)).astype(dtype)
    if layout == "NHWC":
        x, w, dy = x.transpose(0, 2, 3, 1).copy(), w.transpose(2, 3, 1, 0).copy(), dy.transpose(0, 2, 3, 1).copy()
    kw = dict(padding=1, layout=layout)
    expected = reference.conv2d_backward(dy, x, w, **kw)[1]
    with convgen.configure(pixel_rows_nchw_dw_max_weights=0, **dict(VARIANTS["phase planes"])):
        for count in (1, 2, 3):
            threads(count)
            dw = convgen.conv2d_backward(dy, x, w, algorithm="direct", **kw)[1]
            assert_close(dw, expected, dtype, f"dw on {count} threads, {layout}")
        if layout == "NCHW":
            _, call = ops._prepare("conv2d_backward", (dy, x, w), True, "direct", 1, 1, 1, 1, layout,
                                   padding_mode="zeros")
            one, two = (call.kernels().workspace_bytes("bwd_weight", call.problem, count) for count in (1, 2))
            assert two < 2 * one + w.nbytes, (one, two)


# ---------------------------------------------------------------------------------------- the GIL
def _ran_another_thread(call, repeats):
    """Whether this (the main) thread got to run Python code while `call` ran in a worker thread.

    The switch interval is set far beyond the test's length, so the interpreter never takes the GIL
    from the thread holding it: the main thread can run only where the worker gives the GIL up by
    itself. The worker runs `call` up to `repeats` times and looks after each whether the main thread
    has set `seen`, which it does as soon as it runs at all. A call that keeps the GIL never lets it
    run, so the worker finds `seen` unset after every call, however loaded the machine; a call that
    releases it gives the main thread `repeats` chances to be scheduled.
    """
    seen = threading.Event()
    observed = []

    def worker():
        for _ in range(repeats):
            call()
            if seen.is_set():
                observed.append(True)
                return
        observed.append(False)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        thread = threading.Thread(target=worker)
        thread.start()  # returns only once the worker has let go of the GIL (or has finished)
        seen.set()
        thread.join()
    finally:
        sys.setswitchinterval(interval)
    return observed[0]


def test_the_gil_check_tells_a_held_gil_from_a_released_one():
    """The check itself, on libc's usleep: through ctypes.PyDLL it keeps the GIL, through CDLL it lets go."""
    assert not _ran_another_thread(lambda: ctypes.PyDLL(None).usleep(1000), repeats=50)
    assert _ran_another_thread(lambda: ctypes.CDLL(None).usleep(1000), repeats=50)


@pytest.mark.parametrize("entry", ["fwd", "bwd_data", "bwd_weight"])
def test_the_gil_is_released_while_a_kernel_runs(entry, threads):
    """While one Python thread is inside a kernel's entry point, another runs Python code.

    The entry points are called as the ops call them (`Kernels.call`), without the ops' NumPy work
    around them (the bias gradient's reduction), which may let go of the GIL by itself.
    """
    threads(1)
    rng = seeded_rng("gil")
    x = rng.standard_normal((2, 32, 32, 32)).astype(np.float32)
    w = rng.standard_normal((32, 32, 3, 3)).astype(np.float32)
    y = rng.standard_normal((2, 32, 32, 32)).astype(np.float32)
    problem = call_problem("conv2d", x, y, Window(3, 1, 1))
    kernels = kernels_for(problem)
    arrays = {"fwd": (x, w, None, None, None, np.empty_like(y)), "bwd_data": (y, w, None, np.empty_like(x)),
              "bwd_weight": (y, x, np.empty_like(w))}[entry]

    def call():
        kernels.call(entry, problem, arrays)

    call()
    assert _ran_another_thread(call, repeats=200), f"{entry} kept the GIL through all of 200 calls"
