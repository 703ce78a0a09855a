"""One module (or folder) per parallelism: its strategy mixin and the :class:`~..lifecycle.step_part.StepPart` the
mixin declares (``declared_parts``), which the step protocol finds in a strategy's class chain. A preset takes a
parallelism by listing its mixin among its bases; adding one touches no shared file. Modules here import
:mod:`..lifecycle`, never a preset or another parallelism."""
