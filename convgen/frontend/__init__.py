"""The front end: the public NumPy ops and layers.

User arguments are checked and resolved into a `Problem` once (`resolve`, `batching` for unbatched
input), planned, and run on the kernels (`ops` for 2-D, `ndops` with `depthfold` for 1-D and 3-D);
`layers` holds parameters and gradients for plain-NumPy training. Imports the runtime, code
generation and planning floors below it.
"""
