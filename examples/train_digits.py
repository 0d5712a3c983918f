"""Train a small CNN on scikit-learn's 8×8 handwritten digits with convgen's convolution layers.

    .venv/bin/python examples/train_digits.py [--epochs 15] [--seed 0]     # after `make setup`
    PYTHONPATH=. python3 examples/train_digits.py                         # or from a checkout

The network: conv 3×3 (1 → 16) → ReLU → 2×2 max-pool → conv 3×3 (16 → 32) → ReLU → 2×2 max-pool →
dense (128 → 10) → softmax cross-entropy, trained with Adam (cosine-decayed step size) on 80% of the
1797 images. The two convolutions are `convgen.Conv2d` layers (compiled C); everything else is plain
NumPy. Each epoch prints the training loss and the accuracy on the held-out 20%, which is never
trained on. The first run compiles the convolution kernels (a second or two); later runs load them
from the cache.

Needs scikit-learn (the `examples` and `test` extras: pip install 'convgen[examples]').
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

import convgen

TARGET = 0.95  # the held-out accuracy this example is expected to reach


# --------------------------------------------------------------------------------------- data
def load_data(seed):
    """Digits as float32 NCHW images in [0, 1], split 80/20 with every class in both parts."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None, :, :]  # pixel values are 0..16
    return train_test_split(images, digits.target, test_size=0.2, stratify=digits.target, random_state=seed)


# ------------------------------------------------------------------------------ NumPy layers
class ReLU:
    def forward(self, x):
        self.mask = x > 0
        return x * self.mask

    def backward(self, dy):
        return dy * self.mask


class MaxPool2x2:
    """2×2 max-pooling of NCHW maps with even sides; the gradient goes to each window's maximum."""

    def forward(self, x):
        n, c, h, w = x.shape
        windows = x.reshape(n, c, h // 2, 2, w // 2, 2).transpose(0, 1, 2, 4, 3, 5).reshape(n, c, h // 2, w // 2, 4)
        self.shape = x.shape
        self.argmax = windows.argmax(axis=-1)[..., None]
        return np.take_along_axis(windows, self.argmax, axis=-1)[..., 0]

    def backward(self, dy):
        n, c, h, w = self.shape
        windows = np.zeros((n, c, h // 2, w // 2, 4), dtype=dy.dtype)
        np.put_along_axis(windows, self.argmax, dy[..., None], axis=-1)
        return windows.reshape(n, c, h // 2, w // 2, 2, 2).transpose(0, 1, 2, 4, 3, 5).reshape(n, c, h, w)


class Dense:
    """y = x·W + b on flattened inputs (He-initialized, like the convolutions)."""

    def __init__(self, n_in, n_out, rng):
        self.weight = (rng.standard_normal((n_in, n_out)) * np.sqrt(2.0 / n_in)).astype(np.float32)
        self.bias = np.zeros(n_out, dtype=np.float32)

    def forward(self, x):
        self.shape = x.shape
        self.x = x.reshape(len(x), -1)
        return self.x @ self.weight + self.bias

    def backward(self, dy):
        self.dw = self.x.T @ dy
        self.db = dy.sum(axis=0)
        return (dy @ self.weight.T).reshape(self.shape)

    def parameters(self):
        return [self.weight, self.bias]

    def gradients(self):
        return [self.dw, self.db]


def softmax_cross_entropy(logits, labels):
    """Mean cross-entropy of softmax(logits) and its gradient with respect to the logits."""
    shifted = logits - logits.max(axis=1, keepdims=True)  # exp cannot overflow
    log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    rows = np.arange(len(labels))
    loss = -log_p[rows, labels].mean()
    grad = np.exp(log_p)
    grad[rows, labels] -= 1.0
    return float(loss), grad / len(labels)


class Adam:
    """Adam (Kingma & Ba, 2015) updating the given arrays in place."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8):
        self.params, self.lr, self.betas, self.eps, self.t = params, lr, betas, eps, 0
        self.m = [np.zeros_like(p) for p in params]
        self.v = [np.zeros_like(p) for p in params]

    def step(self, grads):
        self.t += 1
        b1, b2 = self.betas
        scale = self.lr * np.sqrt(1 - b2 ** self.t) / (1 - b1 ** self.t)  # bias correction of m and v
        for p, g, m, v in zip(self.params, grads, self.m, self.v):
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            p -= (scale * m / (np.sqrt(v) + self.eps)).astype(p.dtype)


class Network:
    def __init__(self, rng):
        self.conv1 = convgen.Conv2d(1, 16, 3, padding=1, rng=rng)    # 8×8 → 8×8
        self.conv2 = convgen.Conv2d(16, 32, 3, padding=1, rng=rng)   # 4×4 → 4×4
        self.dense = Dense(32 * 2 * 2, 10, rng)
        self.layers = [self.conv1, ReLU(), MaxPool2x2(), self.conv2, ReLU(), MaxPool2x2(), self.dense]

    def forward(self, x):
        for layer in self.layers:
            x = layer.forward(x)
        return x

    def backward(self, dy):
        for layer in reversed(self.layers):
            dy = layer.backward(dy)

    def parameters(self):
        return self.conv1.parameters() + self.conv2.parameters() + self.dense.parameters()

    def gradients(self):
        return self.conv1.gradients() + self.conv2.gradients() + self.dense.gradients()

    def predict(self, x, batch=512):
        return np.concatenate([self.forward(x[i:i + batch]).argmax(axis=1) for i in range(0, len(x), batch)])


# ---------------------------------------------------------------------------------- training
def main(epochs=15, seed=0, batch_size=32, lr=5e-3, out=sys.stdout):
    """Train for `epochs` epochs and return the final held-out accuracy (a fraction in [0, 1])."""
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {epochs}")
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    x_train, x_test, y_train, y_test = load_data(seed)
    net = Network(rng)
    optimizer = Adam(net.parameters(), lr=lr)
    print(f"digits: {len(x_train)} training and {len(x_test)} held-out 8×8 images; "
          f"{epochs} epochs of batches of {batch_size}", file=out)

    accuracy = 0.0
    for epoch in range(1, epochs + 1):
        # Cosine decay of the step size: large steps early, small ones to settle at the end.
        optimizer.lr = lr * 0.5 * (1 + math.cos(math.pi * (epoch - 1) / epochs))
        order = rng.permutation(len(x_train))
        total = 0.0
        for i in range(0, len(order), batch_size):
            batch = order[i:i + batch_size]
            loss, dlogits = softmax_cross_entropy(net.forward(x_train[batch]), y_train[batch])
            net.backward(dlogits.astype(np.float32))
            optimizer.step(net.gradients())
            total += loss * len(batch)
        accuracy = float((net.predict(x_test) == y_test).mean())
        print(f"epoch {epoch:3d}  loss {total / len(order):.4f}  held-out accuracy {accuracy:.1%}  "
              f"({time.perf_counter() - start:.1f} s)", file=out)

    verdict = "reached" if accuracy >= TARGET else "NOT reached"
    print(f"held-out accuracy {accuracy:.1%} (target {TARGET:.0%}: {verdict}) "
          f"after {epochs} epochs in {time.perf_counter() - start:.1f} s", file=out)
    return accuracy


def _parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=15, help="passes over the training set (default 15)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the split, the initial weights and the batch order (default 0)")
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs must be at least 1, got {args.epochs}")
    if args.seed < 0:
        parser.error(f"--seed must be non-negative, got {args.seed}")
    return args


if __name__ == "__main__":
    arguments = _parse_args()
    main(epochs=arguments.epochs, seed=arguments.seed)
