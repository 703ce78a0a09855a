"""``python -m benchmarks.checkpoint_integrity``: the checkpoint checksum cost (:mod:`benchmarks.studies.checkpoint_integrity`)."""

import sys

from benchmarks.studies.checkpoint_integrity import main

if __name__ == "__main__":
    sys.exit(main())
