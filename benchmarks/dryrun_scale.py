"""``python -m benchmarks.dryrun_scale``: the dry run at 1,024–2,048 ranks (:mod:`benchmarks.studies.dryrun_scale`)."""

import sys

from benchmarks.studies.dryrun_scale import main

if __name__ == "__main__":
    sys.exit(main())
