"""Converted models under DistributedDataParallel: examples/torch_ddp.py runs two processes (gloo, on the
loopback address), bounded in time by this test, and trains the same network with PyTorch's and with
convgen's convolutions. Oracle: the gradient PyTorch computes in this process on both halves of the
batch at once (what DDP's average of the two processes' gradients must equal)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "torch_ddp.py"
TOLERANCE = 1e-5  # float32: the kernels sum in another order than oneDNN, through five layers


def _load_example():
    spec = importlib.util.spec_from_file_location("torch_ddp", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _relative(a, b):
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "results.pt"
    done = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "3", "--out", str(out)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(f"{out}.rank{rank}") for rank in range(2)]
    return done, ranks


@pytest.mark.parametrize("fmt", ["contiguous", "channels_last"])
def test_ddp_gradients_are_the_whole_batchs(ddp_run, fmt):
    example = _load_example()
    _, ranks = ddp_run
    memory_format = example.FORMATS[fmt]
    torch.manual_seed(0)
    model = example.network().to(memory_format=memory_format)  # the runs' initial weights
    halves = [example.batch(0, rank, memory_format) for rank in range(example.WORLD)]
    images, targets = (torch.cat(parts) for parts in zip(*halves))
    torch.nn.functional.mse_loss(model(images), targets).backward()
    wanted = [p.grad for p in model.parameters()]
    for library in example.LIBRARIES:
        results = [rank[(library, fmt)] for rank in ranks]
        for got, want in zip(results[0]["first_gradients"], wanted):
            assert _relative(got, want) <= TOLERANCE, library
        for a, b in zip(results[0]["weights"], results[1]["weights"]):  # every process trained the same
            assert torch.equal(a, b), library
    ours, theirs = ranks[0][("convgen", fmt)], ranks[0][("pytorch", fmt)]
    for a, b in zip(ours["weights"], theirs["weights"]):
        assert _relative(a, b) <= TOLERANCE


def test_ddp_example_prints_its_table_without_warnings(ddp_run):
    done, _ = ddp_run
    lines = done.stdout.splitlines()
    assert lines[0].startswith("DistributedDataParallel, 2 processes (gloo), 3 steps")
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in lines[2:]}
    assert set(rows) == {"contiguous", "channels_last"}
    assert all(v <= TOLERANCE for values in rows.values() for v in values)
    # e.g. DDP's "Grad strides do not match bucket view strides": gradients laid out unlike their weights
    assert "Warning" not in done.stderr, done.stderr[-3000:]
