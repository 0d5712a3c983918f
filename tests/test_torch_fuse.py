"""convgen.torch.fuse: inference models whose Conv2d (+BatchNorm2d)(+activation)(+add) chains run as one
convgen call each, against the same model run by PyTorch unfused (float32 within 1e-4 relative,
float64 within 1e-10), with BatchNorm statistics far from 0 and 1; what it fuses and what it leaves
(a training-mode BatchNorm never folded); gradients and tracing through the PyTorch path.
"""

import copy

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import convgen.torch as cgt  # noqa: E402
from convgen.torch.fuse import FusedConv2d  # noqa: E402

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10}


def _bn(channels):
    return nn.BatchNorm2d(channels)


class Block(nn.Module):
    """Every pattern fuse knows, one after another: conv-BN-ReLU; a ResNet block end (conv-BN, add,
    ReLU, through `+=`); a MobileNetV2 projection (conv-BN, add); an activation then the add
    (torch.add); functional activations with parameters; a grouped and a depthwise convolution; a
    convolution with a bias and no BatchNorm; a reflect-padded one."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), _bn(16), nn.ReLU(inplace=True))
        self.a = nn.Conv2d(16, 16, 3, 1, 1, bias=False)
        self.a_bn = _bn(16)
        self.b = nn.Conv2d(16, 16, 1, bias=False)
        self.b_bn = _bn(16)
        self.c = nn.Conv2d(16, 16, 3, 1, 1)
        self.c_act = nn.ReLU6()
        self.d = nn.Conv2d(16, 32, 3, 1, 1, groups=4, bias=False)
        self.d_bn = _bn(32)
        self.e = nn.Conv2d(32, 32, 3, 1, 1, groups=32, bias=False)
        self.e_bn = _bn(32)
        self.f = nn.Conv2d(32, 24, 1)
        self.g = nn.Conv2d(24, 24, 3, padding=1, padding_mode="reflect")
        self.h = nn.Conv2d(24, 8, 3, padding=1)
        self.h_act = nn.GELU(approximate="tanh")
        self.i = nn.Conv2d(8, 8, 1)
        self.i_act = nn.Hardswish()
        self.j = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        x = self.stem(x)
        out = self.a_bn(self.a(x))
        out += x
        x = F.relu(out)
        x = x + self.b_bn(self.b(x))
        x = torch.add(self.c_act(self.c(x)), x)
        x = F.leaky_relu(self.d_bn(self.d(x)), 0.2)
        x = nn.functional.silu(self.e_bn(self.e(x)))
        x = torch.sigmoid(self.f(x))
        x = F.hardtanh(self.g(x), -0.5, 0.75)
        x = self.h_act(self.h(x))
        x = self.i_act(self.i(x))
        return self.j(x).relu()


def _randomized(model, dtype=torch.float32):
    """The model in eval mode, dtype, with BatchNorm statistics and affine parameters far from 0 and 1."""
    generator = torch.Generator().manual_seed(3)
    model = model.to(dtype).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                n = module.num_features
                module.running_mean.copy_(torch.rand(n, generator=generator, dtype=dtype) * 10 - 5)
                module.running_var.copy_(10 ** (torch.rand(n, generator=generator, dtype=dtype) * 4 - 2))
                module.weight.copy_(torch.rand(n, generator=generator, dtype=dtype) * 3 - 1)
                module.bias.copy_(torch.rand(n, generator=generator, dtype=dtype) * 4 - 2)
    return model


def _relative(got, want):
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("dtype, memory_format, computed_in", [
    (torch.float32, torch.contiguous_format, "channels_last"), (torch.float32, torch.contiguous_format, "preserve"),
    (torch.float32, torch.channels_last, "channels_last"), (torch.float32, torch.channels_last, "preserve"),
    (torch.float64, torch.contiguous_format, "channels_last")], ids=lambda v: str(v).replace("torch.", ""))
def test_fused_model_matches_pytorch(dtype, memory_format, computed_in):
    """Computed in channels_last (the default: a contiguous input converted once, the output returned
    contiguous) or in each input's own format (NCHW kernels for a contiguous one); float64 through the
    NHWC kernels (tests/test_epilogue.py runs each family's in both layouts and dtypes)."""
    torch.manual_seed(0)
    model = _randomized(Block(), dtype).to(memory_format=memory_format)
    report = cgt.fuse(model, memory_format=computed_in)
    fused = report.model
    x = torch.randn(2, 3, 20, 22, dtype=dtype).to(memory_format=memory_format)
    with torch.inference_mode():
        want = model(x)
        for _ in range(2):  # (the second call runs on the weights laid out by the first)
            got = fused(x)
            assert _relative(got, want) <= TOLERANCE[dtype]
    assert got.is_contiguous(memory_format=memory_format)
    kinds = [entry.module.epilogue.text() for entry in report.fused]
    assert kinds == ["relu", "addrelu", "add", "clampadd", "leakyrelu", "silu", "sigmoid", "clamp", "gelutanh",
                     "hardswish", "relu"]
    assert not report.left
    assert not any(isinstance(m, (nn.BatchNorm2d, nn.Conv2d)) for m in fused.modules())


def test_the_given_model_is_left_as_it_was():
    model = _randomized(Block())
    before = copy.deepcopy(model.state_dict())
    modules = [type(m) for m in model.modules()]
    cgt.fuse(model)
    assert [type(m) for m in model.modules()] == modules
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


def test_training_mode_batchnorm_is_never_folded():
    """A BatchNorm in training mode normalizes by each batch's statistics: it stays PyTorch's, said
    in the report, and the model computes what it did (its convolutions still convgen's)."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1))
    model = _randomized(model).train()
    report = cgt.fuse(model)
    assert [entry.name for entry in report.left] == ["1"]
    assert "training mode" in report.left[0].reason and "never folded" in report.left[0].reason
    assert "training mode" in str(report)
    assert any(isinstance(m, nn.BatchNorm2d) for m in report.model.modules())
    x = torch.randn(4, 3, 9, 9)
    with torch.no_grad():
        want = copy.deepcopy(model)(x)
        got = report.model(x)
    assert _relative(got, want) <= 1e-4
    untracked = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8, track_running_stats=False)).eval()
    assert "no running statistics" in cgt.fuse(untracked).left[0].reason


def test_what_cannot_be_fused_is_left_and_reported():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.ConvTranspose2d(8, 4, 2, 2), nn.BatchNorm2d(4)).eval()
    report = cgt.fuse(model)
    left = {entry.name: entry.reason for entry in report.left}
    assert "ConvTranspose2d is left to PyTorch" in left["2"]
    assert "not right after a Conv2d" in left["3"]
    assert [entry.names for entry in report.fused] == [("0", "1")]
    x = torch.randn(1, 3, 10, 10)
    with torch.no_grad():
        assert _relative(report.model(x), model(x)) <= 1e-4


def test_gradients_run_through_pytorch_operations():
    """A call that wants gradients runs the folded arithmetic as PyTorch operations: the input's
    gradient is the unfused model's."""
    model = _randomized(Block(), torch.float64)
    fused = cgt.fuse(model).model
    x = torch.randn(1, 3, 12, 12, dtype=torch.float64, requires_grad=True)
    (dx_want,) = torch.autograd.grad(model(x).square().sum(), x)
    (dx_got,) = torch.autograd.grad(fused(x).square().sum(), x)
    assert _relative(dx_got, dx_want) <= 1e-10


def test_a_traced_call_records_pytorch_operations():
    """torch.compile (dynamo, here with its eager backend) traces the PyTorch path of a fused module."""
    model = _randomized(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()))
    fused = cgt.fuse(model).model
    compiled = torch.compile(fused, backend="eager", fullgraph=True)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert _relative(compiled(x), model(x)) <= 1e-5


def test_fused_module_checks_its_residual():
    conv = nn.Conv2d(4, 4, 3, padding=1)
    module = FusedConv2d(conv, conv.weight, conv.bias, "relu", "before")
    x = torch.randn(1, 4, 6, 6)
    with torch.no_grad():
        with pytest.raises(ValueError, match="residual must be given"):
            module(x)
        with pytest.raises(ValueError, match="residual must have the output's shape"):
            module(x, torch.randn(1, 4, 5, 6))
        y = module(x, torch.ones(1, 4, 6, 6))
        assert _relative(y, F.relu(conv(x) + 1)) <= 1e-5
    assert "epilogue=addrelu" in repr(module)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["contiguous", "channels_last"])
def test_fused_module_takes_inputs_and_residuals_of_any_strides(memory_format):
    """Dense inputs run on their own memory, others on a copy; a residual whose strides are not the
    output's is read through a copy; the output is dense in the layout the call computed in; the
    caller's tensors are left as they were."""
    conv = nn.Conv2d(4, 6, 3, padding=1)
    module = FusedConv2d(conv, conv.weight, conv.bias, "relu", "before")
    x = torch.randn(2, 4, 6, 9).contiguous(memory_format=memory_format)
    cases = [(x, torch.randn(2, 6, 6, 9)),
             (x, torch.randn(2, 6, 6, 9).contiguous(memory_format=torch.channels_last)),
             (x, torch.randn(1, 6, 1, 1).expand(2, 6, 6, 9)),          # strides of 0
             (x[..., 1:8], torch.randn(2, 6, 6, 7)),                     # a window of x's memory
             (x[:, :, ::2], torch.randn(2, 6, 3, 9)[..., :]),           # every other row
             (x, torch.randn(2, 6, 6, 9))]                                # the first signature again
    with torch.no_grad():
        for xi, residual in cases:
            kept_x, kept_residual = xi.clone(), residual.clone()
            y = module(xi, residual)
            assert _relative(y, F.relu(conv(xi) + residual)) <= 1e-5
            last = xi.is_contiguous(memory_format=torch.channels_last) and not xi.is_contiguous()
            assert y.is_contiguous(memory_format=torch.channels_last if last else torch.contiguous_format)
            assert torch.equal(xi, kept_x) and torch.equal(residual, kept_residual)


class WritesIntoItsInput(nn.Module):
    """identity.add_(conv(x)): the add writes into the residual, which the model reads again after
    through another name (both names see the write)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        identity = x * 1.0
        alias = identity
        identity.add_(self.conv(x))
        return identity + alias


def test_an_add_that_writes_into_the_residual_is_not_fused():
    model = WritesIntoItsInput().eval()
    report = cgt.fuse(model)
    assert [entry.module.epilogue.text() for entry in report.fused] == [""]
    x = torch.randn(1, 4, 6, 6)
    with torch.no_grad():
        assert _relative(report.model(x), model(x)) <= 1e-5


def test_fuse_takes_a_module_and_a_memory_format():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        cgt.fuse(lambda x: x)
    with pytest.raises(ValueError, match="memory_format must be one of"):
        cgt.fuse(nn.Conv2d(1, 1, 1), memory_format="nhwc")


def test_channels_last_inside_a_contiguous_model():
    """By default a contiguous model computes in channels_last: its convolutions see channels_last
    inputs (convgen's NHWC kernels), and it gives back a contiguous output; with "preserve" they see
    the input's own format."""
    model = _randomized(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 8, 3, padding=1)))
    seen = {}
    for memory_format in ("channels_last", "preserve"):
        fused = cgt.fuse(model, memory_format=memory_format).model
        convs = [m for m in fused.modules() if isinstance(m, FusedConv2d)]
        handles = [conv.register_forward_pre_hook(
            lambda module, args, key=memory_format: seen.setdefault(key, []).append(
                args[0].is_contiguous(memory_format=torch.channels_last) and not args[0].is_contiguous()))
            for conv in convs]
        x = torch.randn(2, 3, 10, 10)
        with torch.no_grad():
            y = fused(x)
            assert y.is_contiguous() and _relative(y, model(x)) <= 1e-4
        for handle in handles:
            handle.remove()
    assert seen == {"channels_last": [True, True], "preserve": [False, False]}


def test_a_large_output_is_written_again_only_once_nothing_holds_it():
    """An output of KEPT_OUTPUT_BYTES or more is kept and the next call writes there, but only when
    no tensor, view or array of it is left (then nobody could see the write)."""
    from convgen.torch.fuse import KEPT_OUTPUT_BYTES

    model = _randomized(nn.Sequential(nn.Conv2d(16, 96, 1), nn.BatchNorm2d(96), nn.ReLU6()))
    fused = cgt.fuse(model, memory_format="preserve").model
    x = torch.randn(8, 16, 112, 112)
    with torch.no_grad():
        want = model(x)
        first = fused(x)
        assert first.numel() * 4 >= KEPT_OUTPUT_BYTES
        address = first.data_ptr()
        held = fused(x)                       # the first output is still held: a new one
        assert held.data_ptr() != address and torch.equal(held, first)
        del first
        view = held[0]
        del held
        again = fused(x)                      # a view of the last one lives: a new one
        assert again.data_ptr() != view.data_ptr()
        array = again.numpy()
        address = again.data_ptr()
        del again
        after = fused(x)                      # an array of it lives: a new one
        assert after.data_ptr() != address
        address = after.data_ptr()
        del after, array, view
        last = fused(x)                       # nothing holds it: written again
        assert last.data_ptr() == address
        assert _relative(last, want) <= 1e-4
