"""``python -m tqindex``: the command line (see :mod:`tqindex.cli`)."""

from .cli import main

raise SystemExit(main())
