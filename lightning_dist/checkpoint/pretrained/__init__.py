"""Pretrained weights in (pure PyTorch): safetensors files read into a model, sharded or not, each rank reading only
its slices (:func:`load_pretrained`); :func:`check_pretrained_fit` refuses files that do not fit, from their headers."""

from lightning_dist.checkpoint.pretrained.files import PretrainedFiles, read_pretrained_files
from lightning_dist.checkpoint.pretrained.load import (
    PretrainedLoad,
    check_pretrained_fit,
    load_pretrained,
    read_threads,
)
from lightning_dist.checkpoint.pretrained.matching import KeyMatch, match_keys

__all__ = [
    "KeyMatch",
    "PretrainedFiles",
    "PretrainedLoad",
    "check_pretrained_fit",
    "load_pretrained",
    "match_keys",
    "read_pretrained_files",
    "read_threads",
]
