"""``python -m benchmarks.zeropp_quantization``: ZeRO++'s quantization kernels per step, eager against compiled (:mod:`benchmarks.studies.zeropp_quantization`)."""

import sys

from benchmarks.studies.zeropp_quantization import main

if __name__ == "__main__":
    sys.exit(main())
