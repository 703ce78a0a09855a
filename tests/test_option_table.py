"""``docs/options.md`` is generated from the code (``python tests/option_table.py --write``) and kept current; the
options of one parallelism mean the same on its strategy and on hybrid3d (same default)."""

from __future__ import annotations

from option_table import DOC, class_options, render  # type: ignore[import-not-found]

from lightning_dist import ContextParallelStrategy, Hybrid3DStrategy, PipelineStrategy, TensorParallelStrategy
from lightning_dist.parallel.mesh import AXIS_OPTIONS

SIZES = {name for names in AXIS_OPTIONS.values() for name in names}  # each preset sizes its own mesh


def test_docs_options_md_is_generated_from_the_code():
    assert DOC.read_text() == render(), "docs/options.md is out of date: run `python tests/option_table.py --write`"


def test_the_options_of_one_parallelism_have_one_default_on_its_strategy_and_on_hybrid3d():
    hybrid = class_options(Hybrid3DStrategy)
    for cls in (PipelineStrategy, ContextParallelStrategy, TensorParallelStrategy):
        for option, (default, _) in class_options(cls).items():
            if option in hybrid and option not in SIZES:
                assert hybrid[option][0] == default, (cls.__name__, option, default, hybrid[option][0])
