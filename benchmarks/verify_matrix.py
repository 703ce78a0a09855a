"""``python -m benchmarks.verify_matrix``: the verify matrix (:mod:`benchmarks.verify.matrix`)."""

import sys

from benchmarks.verify.matrix import main

if __name__ == "__main__":
    sys.exit(main())
