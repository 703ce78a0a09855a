"""Pipeline parallelism in a strategy: :mod:`.stages` (the options and the stage cut, a mixin), :mod:`.step` (the
steps through the schedule, a mixin on top of it), :mod:`.logs` (what the micro-batch steps log, shared from the loss
stage) and :mod:`.part` (its part in a step)."""
