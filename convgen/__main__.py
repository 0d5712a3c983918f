"""`python -m convgen`: the same command line as the `convgen` script (convgen/cli.py)."""

from .cli import main

raise SystemExit(main())
