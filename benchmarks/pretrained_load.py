"""``python -m benchmarks.pretrained_load``: host memory of pretrained loads (:mod:`benchmarks.studies.pretrained_load`)."""

import sys

from benchmarks.studies.pretrained_load import main

if __name__ == "__main__":
    sys.exit(main())
