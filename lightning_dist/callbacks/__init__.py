"""Callbacks a user adds to the Trainer (in Python or YAML): :class:`MeshThroughputMonitor` (tokens/s and MFU over the
mesh) and :class:`ExportAtFitEnd` (a Hugging Face, PEFT or litgpt folder written when ``fit`` ends)."""

from lightning_dist.callbacks.export import ExportAtFitEnd
from lightning_dist.callbacks.throughput import MeshThroughputMonitor

__all__ = ["ExportAtFitEnd", "MeshThroughputMonitor"]
