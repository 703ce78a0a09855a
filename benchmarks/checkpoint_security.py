"""``python -m benchmarks.checkpoint_security``: the restricted checkpoint reader's cost (:mod:`benchmarks.studies.checkpoint_security`)."""

import sys

from benchmarks.studies.checkpoint_security import main

if __name__ == "__main__":
    sys.exit(main())
