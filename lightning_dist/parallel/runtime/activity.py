"""What a rank's main thread is doing, as the watchdog publishes it: waiting in a collective, or running code.

When a collective times out, the rank that raises is one that waited, not the one that stopped answering. The ranks
that were not inside any collective at that moment are the ones the others waited for; their innermost frame says
where they were (a ``time.sleep`` in ``training_step``, a slow data loader, a deadlock in user code).
"""

from __future__ import annotations

import os
import threading

from lightning_dist.compat import thread_frame

#: What :func:`main_thread_activity` says of a main thread inside torch.distributed (issuing or waiting on a
#: collective).
IN_COLLECTIVE = "in a collective"
_COLLECTIVE_FOLDER = f"{os.sep}torch{os.sep}distributed{os.sep}"
#: How gloo and NCCL word a collective that gave up waiting.
_TIMEOUT_WORDINGS = ("Timed out waiting", "collective operation timeout")


def main_thread_activity() -> str:
    """:data:`IN_COLLECTIVE`, or the main thread's innermost frame as ``"function (file:line)"``."""
    frame = thread_frame(threading.main_thread())
    if frame is None:
        return "not running Python code"
    if _COLLECTIVE_FOLDER in frame.f_code.co_filename:
        return IN_COLLECTIVE
    return f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})"


def is_timeout(error: BaseException) -> bool:
    """Whether ``error`` is a collective that gave up waiting (gloo's and NCCL's wordings)."""
    return any(wording in str(error) for wording in _TIMEOUT_WORDINGS)
