"""``python -m lowcomm``: the same entry point as the ``lowcomm`` command (workers run it)."""

from lowcomm.cli import main

raise SystemExit(main())
