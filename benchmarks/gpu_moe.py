"""``python -m benchmarks.gpu_moe``: fsdp2 against expert parallelism on several GPUs (:mod:`benchmarks.gpu.moe`)."""

import os
import sys

from benchmarks.gpu.moe import main

if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
