"""Convert a small PyTorch network to convgen and time both: training steps and inference batches.

    .venv/bin/python examples/torch_interop.py [--batch 16] [--size 32] [--repeat 9]   # after `make`
    .venv/bin/python examples/torch_interop.py --threads 1                            # on a busy machine
    .venv/bin/python examples/torch_interop.py --quick                                # a few seconds

The network (an encoder-decoder on 3-channel images):

    conv 3×3 (3 → 32) → ReLU → conv 3×3 stride 2 (32 → 64) → ReLU
    → grouped conv 3×3 (64 → 64, 32 groups) → ReLU → conv 3×3 (64 → 64) → ReLU
    → transposed conv 4×4 stride 2 (64 → 32) → ReLU → conv 1×1 (32 → 3)

is built with `torch.nn`, copied, and the copy converted with `convgen.torch.convert`. For float32
and float64, contiguous and channels_last, the script first checks that both give the same outputs
and gradients, then times a training step (forward, MSE loss, backward, SGD update) and an inference
batch (`torch.inference_mode`), alternating PyTorch and convgen, and prints the medians. Every
window here is in kernels.toml, so after `make` no kernel is compiled; otherwise the warm-up call
compiles them once.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time

import torch

import convgen
import convgen.torch as cgt

CONFIGS = [(torch.float32, torch.contiguous_format), (torch.float32, torch.channels_last),
           (torch.float64, torch.contiguous_format), (torch.float64, torch.channels_last)]
FORMAT_NAMES = {torch.contiguous_format: "contiguous", torch.channels_last: "channels_last"}
# Outputs and gradients of the converted network against PyTorch's: max |Δ| / max |PyTorch's|.
AGREEMENT = {torch.float32: 1e-4, torch.float64: 1e-10}


def build_network() -> torch.nn.Module:
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1, groups=32), nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
        nn.ConvTranspose2d(64, 32, 4, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(32, 3, 1))


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux) and the cores this process may use."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            name = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name}, {cores} cores"


def _relative(a, b) -> float:
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)


def agreement(torch_net, convgen_net, x, target) -> float:
    """The largest relative difference of the output, the input gradient and every parameter gradient."""
    results = []
    for net in (torch_net, convgen_net):
        xg = x.detach().clone().requires_grad_(True)
        y = net(xg)
        grads = torch.autograd.grad(torch.nn.functional.mse_loss(y, target), [xg, *net.parameters()])
        results.append([y.detach(), *grads])
    return max(_relative(ours, theirs) for ours, theirs in zip(results[1], results[0]))


def training_step(net, optimizer, x, target):
    optimizer.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(net(x), target).backward()
    optimizer.step()


def inference(net, x):
    with torch.inference_mode():
        net(x)


def alternate(calls: dict, repeat: int) -> dict:
    """Median seconds of each call, timed in turn (A B A B ...) so both see the same machine load."""
    samples = {name: [] for name in calls}
    for _ in range(repeat):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def _ratio(torch_time: float, convgen_time: float) -> str:
    ratio = torch_time / convgen_time
    return f"{ratio:.2f}× faster" if ratio >= 1 else f"{1 / ratio:.2f}× slower"


def main(argv=None, out=sys.stdout) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16, help="images per batch (default 16)")
    parser.add_argument("--size", type=int, default=32, help="image height and width, a multiple of 2 (default 32)")
    parser.add_argument("--repeat", type=int, default=9, help="timed samples of each pass (default 9)")
    parser.add_argument("--threads", type=int, help="threads for both PyTorch and convgen (default: each its own "
                                                    "default, every core)")
    parser.add_argument("--quick", action="store_true", help="batch 2 of 8×8 images, 2 samples: a smoke test")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.size, args.repeat = 2, 8, 2
    if args.threads:
        torch.set_num_threads(args.threads)
        convgen.set_num_threads(args.threads)

    torch.manual_seed(0)
    network = build_network()
    report = cgt.convert(copy.deepcopy(network))
    print(f"CPU: {cpu_name()}; PyTorch {torch.__version__} (threads: {torch.get_num_threads()}), "
          f"convgen {convgen.__version__} (threads: {convgen.num_threads()})", file=out)
    print(f"batch of {args.batch} images 3×{args.size}×{args.size}; {report}".replace("\n", "\n  "), file=out)
    load = f"; load average {os.getloadavg()[0]:.1f} at the start" if hasattr(os, "getloadavg") else ""
    print(f"medians of {args.repeat} alternated samples{load}\n", file=out)
    print(f"{'dtype':8} {'memory format':14} {'pass':16} {'PyTorch':>10} {'convgen':>10}  convgen vs PyTorch", file=out)

    rows = []
    for dtype, memory_format in CONFIGS:
        torch_net = network.to(dtype=dtype, memory_format=memory_format)
        convgen_net = cgt.convert(copy.deepcopy(torch_net)).model
        x = torch.randn(args.batch, 3, args.size, args.size, dtype=dtype).to(memory_format=memory_format)
        target = torch.randn_like(x)
        diff = agreement(torch_net, convgen_net, x, target)  # also the warm-up: kernels load (or compile)
        optimizers = {name: torch.optim.SGD(net.parameters(), lr=1e-3)
                      for name, net in (("PyTorch", torch_net), ("convgen", convgen_net))}
        passes = {
            "training step": {name: (lambda net=net, name=name: training_step(net, optimizers[name], x, target))
                              for name, net in (("PyTorch", torch_net), ("convgen", convgen_net))},
            "inference batch": {name: (lambda net=net: inference(net, x))
                                for name, net in (("PyTorch", torch_net), ("convgen", convgen_net))},
        }
        for name, calls in passes.items():
            for call in calls.values():
                call()  # warm-up of this pass
            times = alternate(calls, args.repeat)
            rows.append(dict(dtype=str(dtype).removeprefix("torch."), memory_format=FORMAT_NAMES[memory_format],
                             name=name, pytorch=times["PyTorch"], convgen=times["convgen"], agreement=diff))
            row = rows[-1]
            print(f"{row['dtype']:8} {row['memory_format']:14} {name:16} {row['pytorch'] * 1e3:7.2f} ms "
                  f"{row['convgen'] * 1e3:7.2f} ms  {_ratio(row['pytorch'], row['convgen'])}", file=out)
    worst = {dtype: max(r["agreement"] for r in rows if r["dtype"] == str(dtype).removeprefix("torch."))
             for dtype in AGREEMENT}
    print("\noutputs and gradients, largest relative difference to PyTorch: "
          + ", ".join(f"{str(dtype).removeprefix('torch.')} {value:.1e} (within {AGREEMENT[dtype]:.0e}: "
                      f"{'yes' if value <= AGREEMENT[dtype] else 'NO'})" for dtype, value in worst.items()),
          file=out)
    if hasattr(os, "getloadavg"):
        print(f"load average {os.getloadavg()[0]:.1f} at the end", file=out)
    return rows


if __name__ == "__main__":
    main()
