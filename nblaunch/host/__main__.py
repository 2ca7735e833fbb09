"""``python -m nblaunch.host RUN_DIR LEASE_FD``: run a detached run (see nblaunch.host.main)."""

import sys

from nblaunch.host.main import main

sys.exit(main(sys.argv[1:]))
