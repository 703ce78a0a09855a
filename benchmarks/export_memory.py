"""``python -m benchmarks.export_memory``: what an export holds in memory (:mod:`benchmarks.studies.export_memory`)."""

import sys

from benchmarks.studies.export_memory import main

if __name__ == "__main__":
    sys.exit(main())
