"""``python -m benchmarks.gpu``: the one-GPU throughput comparison (:mod:`benchmarks.gpu.throughput`)."""

import os
import sys

from benchmarks.gpu.throughput import main

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.exit(main())
