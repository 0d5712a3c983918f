"""Planning, the bottom floor: what a convolution is and how it will be computed.

The frozen value types (`spec`: windows and kernel specs with their text form; `ndspec`: 1-D and 3-D
windows and the 2-D kernels that run them; `problem`: one call's resolved geometry), the schedule
table per instruction set (`schedule`), Winograd's transforms and accuracy bounds (`winograd`), and
the planner that picks a problem's algorithm family and schedule (`planner`). Nothing here compiles,
loads or runs anything; every other floor imports from this one.
"""
