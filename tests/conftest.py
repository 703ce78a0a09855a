import os
import sys
from pathlib import Path

# Every process the tests launch inherits it: a C++ std::terminate (an abort at exit, say) prints its stack
# ("Unhandled exception caught in c10/util/AbortHandler.h" and the frames) instead of one line.
os.environ.setdefault("TORCH_CUSTOM_TERMINATE", "1")

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
