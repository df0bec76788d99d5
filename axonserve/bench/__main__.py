"""`python -m axonserve.bench ...` until the bench command is hooked into `axonserve`."""

import sys

from axonserve.bench.cli import main

sys.exit(main())
