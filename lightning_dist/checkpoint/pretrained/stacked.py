"""Parameters a file holds under other names or in pieces: transformers 5 keeps a mixture-of-experts layer's experts
stacked in one parameter (``mlp.experts.gate_up_proj``: ``[experts, 2 × intermediate, hidden]``) while the published
checkpoints, and ``save_pretrained`` itself, hold one tensor per expert and projection
(``block_sparse_moe.experts.3.w1.weight``). The model's own conversion table says how they relate
(:func:`~lightning_dist.compat.hugging_face.checkpoint_conversions`): a renamed parameter becomes an alias of its
file name (loaded by DCP like any other), a stacked one a :class:`StackedSource`, which each rank reads itself: only
the experts (and rows) its block of the parameter holds, through ``safetensors``' slices.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from lightning_dist.checkpoint.pretrained.files import PretrainedFiles
from lightning_dist.compat import local_region

Renaming = tuple[str, str]  # (on disk, in the model)
Stacking = tuple[tuple[str, ...], str, bool]  # (sources with "*" for the expert, target, concatenated on dim 1)


@dataclass(frozen=True)
class StackedSource:
    """A stacked parameter's file tensors: ``keys[expert][source]``, stacked on dim 0 and, when ``concatenated``, the
    sources of one expert concatenated on dim 1 (gate, then up)."""

    keys: tuple[tuple[str, ...], ...]
    concatenated: bool

    def shape(self, files: PretrainedFiles) -> tuple[int, ...]:
        """The stacked parameter's shape the pieces make."""
        first = [files.tensors[key].shape for key in self.keys[0]]
        if self.concatenated:
            return (len(self.keys), sum(shape[0] for shape in first), *first[0][1:])
        return (len(self.keys), *first[0])

    def dtypes(self, files: PretrainedFiles) -> set[torch.dtype]:
        return {files.tensors[key].dtype for row in self.keys for key in row}


def renamed_names(name: str, renamings: Sequence[Renaming]) -> list[str]:
    """The names a file may hold the model's ``name`` under: the name itself, then each renaming undone."""
    return [name, *(name.replace(in_model, on_disk) for on_disk, in_model in renamings if in_model in name)]


def find_stacked(
    name: str,
    experts: int,
    file_keys: Collection[str],
    renamings: Sequence[Renaming],
    stackings: Sequence[Stacking],
) -> StackedSource | None:
    """The file tensors the model's stacked parameter ``name`` (``experts`` long on dim 0) is made of, if the file
    holds every one of them."""
    for sources, target, concatenated in stackings:
        if target not in name:
            continue
        keys = []
        for expert in range(experts):
            row = []
            for source in sources:
                piece = name.replace(target, source.replace("*", str(expert)))
                held = [key for key in renamed_names(piece, renamings) if key in file_keys]
                if not held:
                    break
                row.append(held[0])
            if len(row) != len(sources):
                break
            keys.append(tuple(row))
        if len(keys) == experts:
            return StackedSource(tuple(keys), concatenated)
    return None


def read_stacked(target: torch.Tensor, source: StackedSource, files: PretrainedFiles) -> int:
    """Fill this rank's block of ``target`` (a DTensor or a plain tensor) from the file pieces it covers, converted to
    its dtype. Returns how many elements were read."""
    from safetensors import safe_open  # a dependency of transformers, whose models this reads

    offsets, shape = local_region(target)
    local = target.to_local() if hasattr(target, "to_local") else target
    read = 0
    handles: dict[str, object] = {}
    with torch.no_grad():
        for expert in range(offsets[0], offsets[0] + shape[0]):
            start = 0  # the piece's first row in the stacked parameter's dim 1
            for key in source.keys[expert]:
                piece = files.tensors[key]
                rows = piece.shape[0] if source.concatenated else None
                if source.concatenated:
                    low, high = max(offsets[1], start), min(offsets[1] + shape[1], start + rows)
                    start += rows
                    if low >= high:
                        continue
                    where = (slice(low - start + rows, high - start + rows), *_rest(offsets[2:], shape[2:]))
                    into = local[expert - offsets[0], low - offsets[1] : high - offsets[1]]
                else:
                    where, into = _rest(offsets[1:], shape[1:]), local[expert - offsets[0]]
                handle = handles.setdefault(str(piece.file), safe_open(str(piece.file), framework="pt"))
                values = handle.get_slice(key)[where]  # type: ignore[attr-defined]
                into.copy_(values.reshape(into.shape))
                read += values.numel()
    return read


def _rest(offsets: Sequence[int], shape: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(offset, offset + size) for offset, size in zip(offsets, shape))
