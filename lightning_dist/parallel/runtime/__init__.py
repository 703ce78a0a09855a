"""What keeps a multi-process run safe while it runs, pure PyTorch (no Lightning import). Which file holds what:

- :mod:`.watchdog` — :class:`FailureWatchdog`: a rank that fails tells the others through the store, so none hangs
  in a collective.
- :mod:`.nonfinite` — a NaN or infinite loss or gradient on any rank, found and agreed on by every rank.
- :mod:`.process_group_exit` — process groups destroyed at exit, so no communication thread outlives the interpreter.
"""

from lightning_dist.parallel.runtime.nonfinite import NonFiniteError, NonFiniteReport
from lightning_dist.parallel.runtime.process_group_exit import destroy_process_groups
from lightning_dist.parallel.runtime.watchdog import FailureWatchdog

__all__ = ["FailureWatchdog", "NonFiniteError", "NonFiniteReport", "destroy_process_groups"]
