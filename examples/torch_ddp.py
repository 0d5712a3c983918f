"""Data-parallel training of a converted model under torch.nn.parallel.DistributedDataParallel.

Two processes on this machine (the gloo backend, over the loopback address) each take half of every
batch; DDP averages their gradients. The same run is made twice, with the network's own PyTorch
convolutions and after `convgen.torch.convert`, in both memory formats, and the example prints how
far apart the two runs' gradients and weights are:

    python examples/torch_ddp.py [--steps 3] [--out results.pt]

Convert first, then wrap: `convert` keeps the model's Parameter objects (and lays a channels_last
model's weights out in the order convgen reads, once), so DDP, built afterwards, registers the
Parameters and strides the training uses.
"""

from __future__ import annotations

import argparse
import datetime
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import convgen.torch as cgt  # noqa: E402

WORLD = 2                    # processes
PER_RANK = 2                 # images per process and step
SIZE = 16                    # image height and width
FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}
LIBRARIES = ("pytorch", "convgen")


def network() -> torch.nn.Module:
    """A small encoder-decoder: strided, grouped and transposed convolutions, no BatchNorm (whose
    per-process statistics would need SyncBatchNorm to match a one-process run)."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 16, 3, padding=1, groups=2), torch.nn.ReLU(),
        torch.nn.ConvTranspose2d(16, 8, 4, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 3, 1, bias=False))


def batch(step: int, rank: int, memory_format=torch.contiguous_format):
    """(images, targets) of one process at one step: the same on every run."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    images = torch.randn(PER_RANK, 3, SIZE, SIZE, generator=generator).to(memory_format=memory_format)
    return images, torch.randn(PER_RANK, 3, SIZE, SIZE, generator=generator)


def model_for(library: str, memory_format) -> torch.nn.Module:
    torch.manual_seed(0)
    model = network().to(memory_format=memory_format)
    if library == "convgen":
        report = cgt.convert(model)
        assert not report.left, str(report)
    return model


def train(model: torch.nn.Module, rank: int, steps: int, memory_format) -> dict:
    """Train under DDP for `steps` SGD steps: the first step's gradients and the final weights."""
    parallel = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(parallel.parameters(), lr=0.05, momentum=0.9)
    first_gradients = None
    for step in range(steps):
        images, targets = batch(step, rank, memory_format)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(parallel(images), targets).backward()
        if first_gradients is None:
            first_gradients = [p.grad.detach().clone() for p in model.parameters()]
        optimizer.step()
    return {"first_gradients": first_gradients, "weights": [p.detach().clone() for p in model.parameters()]}


def worker(rank: int, port: int, steps: int, out: str) -> None:
    torch.set_num_threads(1)  # two processes on two cores: one thread each (convgen follows PyTorch's count)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    try:
        results = {(library, name): train(model_for(library, fmt), rank, steps, fmt)
                   for name, fmt in FORMATS.items() for library in LIBRARIES}
        torch.save(results, f"{out}.rank{rank}")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(steps: int, out: str) -> list[dict]:
    """Start the processes, wait for them, and return each rank's results."""
    mp.spawn(worker, args=(_free_port(), steps, out), nprocs=WORLD, join=True)
    return [torch.load(f"{out}.rank{rank}") for rank in range(WORLD)]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="SGD steps (default 3)")
    parser.add_argument("--out", help="where to write each rank's results (OUT.rank0, OUT.rank1)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        ranks = run(args.steps, args.out or str(Path(scratch) / "results.pt"))
    print(f"DistributedDataParallel, {WORLD} processes (gloo), {args.steps} steps, float32")
    print(f"{'memory format':<15}{'first gradients':>18}{'final weights':>16}   (convgen vs PyTorch, max relative)")
    for name in FORMATS:
        ours, theirs = ranks[0][("convgen", name)], ranks[0][("pytorch", name)]
        gradients = max(_relative(a, b) for a, b in zip(ours["first_gradients"], theirs["first_gradients"]))
        weights = max(_relative(a, b) for a, b in zip(ours["weights"], theirs["weights"]))
        print(f"{name:<15}{gradients:>18.1e}{weights:>16.1e}")


if __name__ == "__main__":
    main()
