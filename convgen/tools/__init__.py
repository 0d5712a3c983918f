"""Tools around the kernels: the `convgen` command line and what it serves.

Kernel-set files (`specfile`), standalone C export (`export`), side-by-side timing (`timing`), the
NumPy and PyTorch baselines (`baselines`) and the specialized-against-generic comparison (`compare`).
A peer of `convgen.torch` and `convgen.compat` at the top: they import every floor below, and not
each other.
"""
