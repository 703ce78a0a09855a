"""``python -m benchmarks.pipeline``: the pipeline study (:mod:`benchmarks.studies.pipeline`)."""

import sys

from benchmarks.studies.pipeline import main

if __name__ == "__main__":
    sys.exit(main())
