"""``python -m benchmarks.dryrun_truth``: the dry run against real runs (:mod:`benchmarks.studies.dryrun_truth`)."""

import sys

from benchmarks.studies.dryrun_truth import main

if __name__ == "__main__":
    sys.exit(main())
