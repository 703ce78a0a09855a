"""``python -m benchmarks.float8_parity``: the FP8 parity matrix (:mod:`benchmarks.studies.float8_parity`)."""

import sys

from benchmarks.studies.float8_parity import main

if __name__ == "__main__":
    sys.exit(main())
