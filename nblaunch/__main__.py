"""``python -m nblaunch``: the same as the ``nblaunch`` command."""

from nblaunch.cli import main

raise SystemExit(main())
