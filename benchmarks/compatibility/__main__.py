"""``python -m benchmarks.compatibility``: the compatibility matrix (:mod:`benchmarks.compatibility.runner`)."""

import sys

from benchmarks.compatibility.runner import main

sys.exit(main())
