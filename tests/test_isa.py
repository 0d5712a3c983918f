"""Every instruction-set path the machine can run, and the reference micro-kernel, agree with the oracle.

The schedule (and so the micro-kernel's vector width and register tile) is chosen when the C is
generated; forcing a slower path here checks the kernels a machine with only AVX2, or with no
usable SIMD, would get.
"""

import numpy as np
import pytest

import convgen
from convgen import reference
from convgen.kernels import settings
from convgen.schedule import supported_isas
from convgen.spec import ConvSpec, Window
from helpers import assert_close

WINDOWS = [Window(3, 1, 1), Window((5, 2), (2, 1), ((2, 1), (0, 1)), (1, 2))]
PATHS = [dict(isa=isa) for isa in supported_isas(settings().toolchain.compiler)] + [dict(ukernel="reference")]
# Tiny blocks: many K blocks in every op (forward, dx, dW) and many pixel blocks per image.
PATHS.append(dict(kc=24, kc_forward=20, nc=96))


@pytest.fixture(scope="module", params=PATHS, ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()))
def path(request):
    with convgen.configure(**request.param):
        specs = [ConvSpec(w, dtype, "NCHW") for w in WINDOWS for dtype in ("float32", "float64")]
        specs += [ConvSpec(None, dtype, layout) for dtype in ("float32", "float64") for layout in ("NCHW", "NHWC")]
        failures = {s: e for s, e in convgen.build_all(specs).items() if isinstance(e, Exception)}
        assert not failures, failures
        yield request.param


def test_the_forced_schedule_is_the_one_built(path):
    schedule = settings().schedule()
    for key, value in path.items():
        assert getattr(schedule, key) == value
    source = convgen.get_kernels(ConvSpec(WINDOWS[0])).rendered.source
    assert f"schedule {schedule.isa}" in source and f"micro-kernel {schedule.ukernel}" in source


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("specialize", [True, False], ids=["specialized", "generic"])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: w.short())
def test_every_op_matches_reference(path, window, specialize, dtype):
    rng = np.random.default_rng(11)
    kw = dict(stride=window.stride, padding=window.padding, dilation=window.dilation)
    # 20 output channels and 13 input channels (2 groups): edge tiles in every direction.
    x = rng.standard_normal((2, 26, 15, 17)).astype(dtype)
    w = rng.standard_normal((20, 13, *window.kernel)).astype(dtype)
    b = rng.standard_normal(20).astype(dtype)
    y = convgen.conv2d(x, w, b, groups=2, specialize=specialize, **kw)
    assert_close(y, reference.conv2d(x, w, b, groups=2, **kw), dtype, "forward")
    dy = rng.standard_normal(y.shape).astype(dtype)
    for got, want, name in zip(convgen.conv2d_backward(dy, x, w, groups=2, specialize=specialize, **kw),
                               reference.conv2d_backward(dy, x, w, groups=2, **kw), ("dx", "dw", "db")):
        assert_close(got, want, dtype, name)
    t = convgen.conv_transpose2d(dy, w, groups=2, specialize=specialize, **kw)
    assert_close(t, reference.conv_transpose2d(dy, w, groups=2, **kw), dtype, "transposed")


def test_nhwc_generic(path):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 9, 10, 6))
    w = rng.standard_normal((3, 2, 6, 7))
    y = convgen.conv2d(x, w, stride=2, padding=1, layout="NHWC", specialize=False)
    assert_close(y, reference.conv2d(x, w, stride=2, padding=1, layout="NHWC"), np.float64, "NHWC forward")


def test_unsupported_isa_is_refused(monkeypatch):
    """On a machine whose compiler reports only AVX2, asking for AVX-512 is an error, not a crash later."""
    from convgen import schedule
    monkeypatch.setattr(schedule, "supported_isas", lambda compiler: ("avx2", "portable"))
    with pytest.raises(ValueError, match="not supported"):
        with convgen.configure(isa="avx512"):
            pass
    assert schedule.get_schedule("cc").isa == "avx2"  # the best the machine has is the default


def test_unknown_isa_and_schedule_field_are_refused():
    with pytest.raises(ValueError, match="isa must be one of"):
        with convgen.configure(isa="sse9"):
            pass
    with pytest.raises(TypeError, match="unknown schedule fields"):
        with convgen.configure(mc=3):
            pass
    with pytest.raises(ValueError, match="mr must be a positive int"):
        with convgen.configure(mr=0):
            pass
