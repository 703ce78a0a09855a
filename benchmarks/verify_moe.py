"""``python -m benchmarks.verify_moe``: the verify matrix of the mixture-of-experts models (:mod:`benchmarks.verify.moe`)."""

import sys

from benchmarks.verify.moe import main

if __name__ == "__main__":
    sys.exit(main())
