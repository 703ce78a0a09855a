"""``python -m benchmarks.fault_tolerance_chaos``: the fault-tolerance chaos run (:mod:`benchmarks.studies.fault_tolerance_chaos`)."""

import sys

from benchmarks.studies.fault_tolerance_chaos import main

if __name__ == "__main__":
    sys.exit(main())
