"""Model sizes of the benchmark: the example GPT (``examples/gpt.py``) at a few widths and depths, fp32 on CPU."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ModelSize:
    """One GPT configuration.

    Attributes:
        name: Short label used in tables.
        d_model: Residual width (H).
        n_layer: Transformer blocks (L).
        n_head: Attention heads; must divide by every tensor-parallel size used (1, 2, 4).
        vocab_size: Token ids (the example data set has 64 symbols).
        seq_len: Tokens per sample (S).
    """

    name: str
    d_model: int
    n_layer: int
    n_head: int
    vocab_size: int = 64
    seq_len: int = 64

    def gpt_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :class:`examples.gpt.GPT`."""
        out = asdict(self)
        del out["name"]
        return out

    @property
    def num_parameters(self) -> int:
        """Exact parameter count of ``examples.gpt.GPT`` with this configuration (see :func:`gpt_parameter_count`)."""
        return gpt_parameter_count(self)

    @property
    def num_matmul_parameters(self) -> int:
        """Parameters that take part in a matmul per token (everything but the two embedding tables and the
        LayerNorm/bias vectors): the ``N`` of the ``6N`` FLOPs-per-token rule."""
        h, layers = self.d_model, self.n_layer
        return layers * (4 * h * h + 2 * 4 * h * h) + h * self.vocab_size


def gpt_parameter_count(size: ModelSize) -> int:
    """Parameters of ``examples.gpt.GPT``: embeddings, per block 4 bias-free attention projections, an MLP with
    biases (H→4H→H) and two LayerNorms, the final LayerNorm and a bias-free head."""
    h, layers, v, s = size.d_model, size.n_layer, size.vocab_size, size.seq_len
    block = 4 * h * h + (h * 4 * h + 4 * h) + (4 * h * h + h) + 2 * (2 * h)
    return v * h + s * h + layers * block + 2 * h + h * v


SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize("tiny", d_model=64, n_layer=2, n_head=4),
    "small": ModelSize("small", d_model=128, n_layer=4, n_head=4),
    "medium": ModelSize("medium", d_model=256, n_layer=6, n_head=8),
}
