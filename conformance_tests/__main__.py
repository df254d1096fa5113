"""``python -m conformance_tests``: see ``conformance_tests.cli``."""

import sys

from conformance_tests.cli import main

if __name__ == "__main__":
    sys.exit(main())
