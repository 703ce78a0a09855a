import os
import sys
from pathlib import Path

import pytest

# Every process the tests launch inherits it: a C++ std::terminate (an abort at exit, say) prints its stack
# ("Unhandled exception caught in c10/util/AbortHandler.h" and the frames) instead of one line.
os.environ.setdefault("TORCH_CUSTOM_TERMINATE", "1")

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


@pytest.fixture(autouse=True, scope="module")
def no_launcher_state_left_behind():
    """A fit in the test process itself (``devices=1`` under one of our strategies) keeps its process group and leaves
    ``MASTER_PORT``, ``LOCAL_RANK``, ``OMP_NUM_THREADS``... in ``os.environ``: a later module's Trainer would take them
    for a launcher's, and its launched ranks would inherit them (a port still held here, two threads per rank on two
    cores). Each test module ends with the environment it started with and no process group."""
    saved = dict(os.environ)
    yield
    _restore(saved)


def _restore(environment: dict[str, str]) -> None:
    """No process group, and ``os.environ`` as it was."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environment)


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stock Llama (tiny config) trained two steps under fsdp2 in one process, saved as a sharded folder: the
    input of the export and progress tests, which only read it. Made before any module's own fixtures, so it leaves
    the environment and process groups as it found them itself."""
    import torch

    from tests.scenarios.models import tiny_hf_causal_lm
    from tests.test_export import _trained

    root = tmp_path_factory.mktemp("llama_checkpoint")
    saved = dict(os.environ)
    try:
        torch.manual_seed(0)
        _trained(tiny_hf_causal_lm("llama"), root / "llama")
    finally:
        _restore(saved)
    return root / "llama"
