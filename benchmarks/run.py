"""``python -m benchmarks.run``: the CPU scaling suite (:mod:`benchmarks.suite.run`)."""

import sys

from benchmarks.suite.run import main

if __name__ == "__main__":
    sys.exit(main())
