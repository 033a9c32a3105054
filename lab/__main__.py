"""`python -m lab`: the command line (see `lab.cli`)."""

from lab.cli import main

raise SystemExit(main())
