"""``python -m benchmarks.fault_tolerance_overhead``: fault tolerance's step time against HSDP (:mod:`benchmarks.studies.fault_tolerance_overhead`)."""

import sys

from benchmarks.studies.fault_tolerance_overhead import main

if __name__ == "__main__":
    sys.exit(main())
