"""``python -m benchmarks.context_parallel``: the context-parallel study (:mod:`benchmarks.studies.context_parallel`)."""

import sys

from benchmarks.studies.context_parallel import main

if __name__ == "__main__":
    sys.exit(main())
