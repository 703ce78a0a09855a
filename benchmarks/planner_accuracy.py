"""``python -m benchmarks.planner_accuracy``: the planner's estimates against real runs (:mod:`benchmarks.studies.planner_accuracy`)."""

import sys

from benchmarks.studies.planner_accuracy import main

if __name__ == "__main__":
    sys.exit(main())
