"""The runtime: rendered C to callable kernels.

The C compiler on this machine (`toolchain`), compiling one module with cffi (`build`), the on-disk
cache of built modules (`cache`) and the loaded kernels with the one way to call them (`kernels`).
Imports `convgen.codegen` and `convgen.planning`, never the floors above.
"""
