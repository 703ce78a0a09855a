"""``python -m benchmarks.gpu_local_experts``: grouped expert GEMMs against a loop, one GPU (:mod:`benchmarks.gpu.local_experts`)."""

import sys

from benchmarks.gpu.local_experts import main

if __name__ == "__main__":
    sys.exit(main())
