"""`python -m convgen`: the same command line as the `convgen` script (convgen/tools/cli.py)."""

from .tools.cli import main

raise SystemExit(main())
