"""Code generation: a spec and a schedule in, C source out.

The C calling convention declared once (`abi`), the Jinja rendering of one kernel module
(`render`, from the top-level templates/), the depthwise family's window tables (`depthwise`) and
the reading of rendered C for people (`csource`). Imports only `convgen.planning`.
"""
