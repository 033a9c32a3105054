"""`python -m lab`: the command line (see `lab.tools.cli`)."""

from lab.tools.cli import main

raise SystemExit(main())
