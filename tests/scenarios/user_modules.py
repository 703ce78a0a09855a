"""Modules written the way users write them, with habits the package has to follow (trust, round two).

- :class:`OwnSamplerGPT`: the example GPT whose ``*_dataloader`` hooks build their own ``DistributedSampler`` from
  ``self.trainer.strategy.distributed_sampler_kwargs`` and a per-rank batch of ``global_batch // num_replicas``
  (run with ``use_distributed_sampler=False``). In one process (no such kwargs) it reads the whole global batch.
  Debugging code reads ``self.global_rank`` only when ``OWN_SAMPLER_DEBUG`` is set.
- :class:`OptionalSamplerGPT`: the same with a sampler (not shuffled) only when ``num_replicas > 1``: in one
  process a plain loader, read in order; :class:`PlainLoaderGPT` returns plain loaders and leaves the sampler to
  Lightning.
- :class:`GANLike`: manual optimization with two optimizers (a generator and a critic), ``toggle_optimizer``,
  ``manual_backward``, gradient clipping by ``self.clip_gradients``; the critic runs outside ``forward``, twice per
  step. Each sample carries its own noise, so the global batch is the same on any number of ranks.
- :class:`AccumulatingGAN`: :class:`GANLike` accumulating gradients over batches by hand, as Lightning's docs write it
  for manual optimization (each loss divided by k, ``step`` and ``zero_grad`` every k batches).
- :class:`OffsetGAN`: :class:`GANLike` with a parameter of the LightningModule itself (not of a submodule), read in
  ``training_step`` after the generator's update, outside any module call.
- :class:`TwoOptimizerGPT`: the example GPT under manual optimization, with one optimizer for its blocks and one for
  the rest, each updated after a forward and ``manual_backward`` of its own (two per ``training_step``), zeroing
  its gradients after its step as Lightning's GAN example does: each update also sums the gradients of the other
  optimizer's backward.

Only torch, Lightning and the examples; both the scenario scripts (``from user_modules import ...``) and the tests
(``from tests.scenarios.user_modules import ...``) import it, and verify's runs unpickle its classes by this name.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from examples.data import TokenWindows, encode, generate_text
from examples.gpt import GPT


def sampler_kwargs(module: L.LightningModule) -> dict[str, int]:
    """What a user's hook reads: the strategy's sampler kwargs, or one replica when there are none (one process)."""
    kwargs = getattr(module.trainer.strategy, "distributed_sampler_kwargs", None)
    return dict(kwargs) if kwargs else {"num_replicas": 1, "rank": 0}


def own_loader(module: L.LightningModule, dataset: Dataset, global_batch: int, shuffle: bool, seed: int) -> DataLoader:
    kwargs = sampler_kwargs(module)
    sampler = DistributedSampler(dataset, shuffle=shuffle, seed=seed, drop_last=True, **kwargs)
    return DataLoader(dataset, batch_size=global_batch // kwargs["num_replicas"], sampler=sampler, drop_last=True)


class OwnSamplerGPT(GPT):
    """The example GPT with data loaders of its own (see the module docstring).

    Args:
        global_batch: Samples per optimizer step over all data-parallel ranks.
        train_samples: Training windows of ``seq_len`` tokens.
        data_seed: Seed of the sampler's shuffle and of the generated text.
        **gpt: The example GPT's arguments.
    """

    def __init__(self, global_batch: int = 8, train_samples: int = 128, data_seed: int = 0, **gpt: Any) -> None:
        super().__init__(**gpt)
        self.save_hyperparameters()
        tokens = encode(generate_text(train_samples * self.hparams.seq_len + 1, data_seed))
        self.train_set = TokenWindows(tokens, self.hparams.seq_len)
        self.val_set = TokenWindows(
            encode(generate_text(32 * self.hparams.seq_len + 1, data_seed + 1)), self.hparams.seq_len
        )

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if os.environ.get("OWN_SAMPLER_DEBUG"):
            print(f"rank {self.global_rank} batch {batch_idx}: {batch['input_ids'].shape}")
        return super().training_step(batch, batch_idx)

    def train_dataloader(self) -> DataLoader:
        return own_loader(self, self.train_set, self.hparams.global_batch, shuffle=True, seed=self.hparams.data_seed)

    def val_dataloader(self) -> DataLoader:
        return own_loader(self, self.val_set, self.hparams.global_batch, shuffle=False, seed=self.hparams.data_seed)


class OptionalSamplerGPT(OwnSamplerGPT):
    """:class:`OwnSamplerGPT` as projects grown out of plain PyTorch write it: a ``DistributedSampler`` (not
    shuffled) only when there is more than one data-parallel replica, else a plain loader (read in order)."""

    def _loader(self, dataset: Dataset) -> DataLoader:
        kwargs = sampler_kwargs(self)
        replicas = kwargs["num_replicas"]
        sampler = DistributedSampler(dataset, shuffle=False, drop_last=True, **kwargs) if replicas > 1 else None
        return DataLoader(dataset, batch_size=self.hparams.global_batch // replicas, sampler=sampler, drop_last=True)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set)


class PlainLoaderGPT(OwnSamplerGPT):
    """:class:`OwnSamplerGPT` leaving the sampler to Lightning: plain loaders of ``global_batch // num_replicas``."""

    def _loader(self, dataset: Dataset) -> DataLoader:
        return DataLoader(dataset, batch_size=self.hparams.global_batch // sampler_kwargs(self)["num_replicas"])

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set)


class NoisyPairs(Dataset):
    """Sample i: a "real" point of a fixed distribution and the generator's noise for it, both from seed ``i``."""

    def __init__(self, size: int, data_dim: int, noise_dim: int, dtype: torch.dtype = torch.float32) -> None:
        self.size, self.data_dim, self.noise_dim, self.dtype = size, data_dim, noise_dim, dtype

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(index)
        real = torch.randn(self.data_dim, generator=g, dtype=torch.float64) * 0.5 + 1.0
        noise = torch.randn(self.noise_dim, generator=g, dtype=torch.float64)
        return {"real": real.to(self.dtype), "noise": noise.to(self.dtype)}


class GANLike(L.LightningModule):
    """A GAN as Lightning's docs write one: manual optimization, a generator and a critic with an optimizer each.

    Args:
        data_dim, noise_dim, hidden: Sizes of the data, the noise and the hidden layers.
        global_batch: Samples per step over all data-parallel ranks.
        train_samples: Training samples.
        lr: Adam's learning rate of both optimizers.
        clip: Gradient clipping value of both (0: none).
        toggle: Use ``toggle_optimizer``/``untoggle_optimizer`` around each update.
    """

    def __init__(
        self,
        data_dim: int = 16,
        noise_dim: int = 8,
        hidden: int = 32,
        global_batch: int = 8,
        train_samples: int = 128,
        lr: float = 1e-2,
        clip: float = 1.0,
        toggle: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(noise_dim, hidden), nn.Tanh(), nn.Linear(hidden, data_dim))
        self.critic = nn.Sequential(nn.Linear(data_dim, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, noise: torch.Tensor) -> torch.Tensor:
        return self.generator(noise)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        opt_g, opt_c = self.optimizers()
        clip = self.hparams.clip
        # the generator's step: fool the critic
        if self.hparams.toggle:
            self.toggle_optimizer(opt_g)
        fake = self(batch["noise"])
        g_loss = F.softplus(-self.critic(fake)).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        if clip:
            self.clip_gradients(opt_g, gradient_clip_val=clip, gradient_clip_algorithm="norm")
        opt_g.step()
        if self.hparams.toggle:
            self.untoggle_optimizer(opt_g)
        # the critic's step: real against the (detached) fake
        if self.hparams.toggle:
            self.toggle_optimizer(opt_c)
        fake = self(batch["noise"]).detach()
        c_loss = F.softplus(-self.critic(batch["real"])).mean() + F.softplus(self.critic(fake)).mean()
        opt_c.zero_grad()
        self.manual_backward(c_loss)
        if clip:
            self.clip_gradients(opt_c, gradient_clip_val=clip, gradient_clip_algorithm="norm")
        opt_c.step()
        if self.hparams.toggle:
            self.untoggle_optimizer(opt_c)
        self.log_dict({"g_loss": g_loss, "c_loss": c_loss}, sync_dist=True)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        lr = self.hparams.lr
        return [
            torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(0.5, 0.9)),
            torch.optim.Adam(self.critic.parameters(), lr=lr, betas=(0.5, 0.9)),
        ]

    def train_dataloader(self) -> DataLoader:
        h = self.hparams
        dtype = next(self.parameters()).dtype
        dataset = NoisyPairs(h.train_samples, h.data_dim, h.noise_dim, dtype)
        return own_loader(self, dataset, h.global_batch, shuffle=True, seed=0)


class AccumulatingGAN(GANLike):
    """:class:`GANLike` stepping each optimizer every ``accumulate`` batches (see the module docstring).

    Args:
        accumulate: Batches whose gradients each update sums.
        **gan: :class:`GANLike`'s arguments.
    """

    def __init__(self, accumulate: int = 2, **gan: Any) -> None:
        super().__init__(**gan)
        self.save_hyperparameters()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        opt_g, opt_c = self.optimizers()
        h = self.hparams
        update = (batch_idx + 1) % h.accumulate == 0
        if h.toggle:
            self.toggle_optimizer(opt_g)
        g_loss = F.softplus(-self.critic(self(batch["noise"]))).mean()
        self.manual_backward(g_loss / h.accumulate)
        if update:
            if h.clip:
                self.clip_gradients(opt_g, gradient_clip_val=h.clip, gradient_clip_algorithm="norm")
            opt_g.step()
            opt_g.zero_grad()
        if h.toggle:
            self.untoggle_optimizer(opt_g)
            self.toggle_optimizer(opt_c)
        fake = self(batch["noise"]).detach()
        c_loss = F.softplus(-self.critic(batch["real"])).mean() + F.softplus(self.critic(fake)).mean()
        self.manual_backward(c_loss / h.accumulate)
        if update:
            if h.clip:
                self.clip_gradients(opt_c, gradient_clip_val=h.clip, gradient_clip_algorithm="norm")
            opt_c.step()
            opt_c.zero_grad()
        if h.toggle:
            self.untoggle_optimizer(opt_c)
        self.log_dict({"g_loss": g_loss, "c_loss": c_loss}, sync_dist=True)


class OffsetGAN(GANLike):
    """:class:`GANLike` whose critic judges the data less a learned offset, ``self.offset``, that the LightningModule
    holds itself and the critic's optimizer updates (never clipped).

    Args:
        **gan: :class:`GANLike`'s arguments.
    """

    def __init__(self, **gan: Any) -> None:
        super().__init__(**gan)
        self.offset = nn.Parameter(torch.zeros(self.hparams.data_dim))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        opt_g, opt_c = self.optimizers()
        toggle = self.hparams.toggle
        if toggle:
            self.toggle_optimizer(opt_g)
        g_loss = F.softplus(-self.critic(self(batch["noise"]))).mean()
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        if toggle:
            self.untoggle_optimizer(opt_g)
            self.toggle_optimizer(opt_c)
        real = batch["real"] - self.offset  # after the generator's step, outside any module call
        c_loss = F.softplus(-self.critic(real)).mean() + F.softplus(self.critic(self(batch["noise"]).detach())).mean()
        self.manual_backward(c_loss)
        opt_c.step()
        opt_c.zero_grad()
        if toggle:
            self.untoggle_optimizer(opt_c)
        self.log_dict({"g_loss": g_loss, "c_loss": c_loss}, sync_dist=True)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        lr = self.hparams.lr
        return [
            torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(0.5, 0.9)),
            torch.optim.Adam([*self.critic.parameters(), self.offset], lr=lr, betas=(0.5, 0.9)),
        ]


class TwoOptimizerGPT(GPT):
    """The example GPT trained by hand with two optimizers (see the module docstring).

    Args:
        clip: Gradient clipping value of both optimizers (0: none).
        **gpt: The example GPT's arguments.
    """

    def __init__(self, clip: float = 1.0, **gpt: Any) -> None:
        super().__init__(**gpt)
        self.save_hyperparameters()
        self.automatic_optimization = False

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        losses = {}
        for name, optimizer in zip(("blocks_loss", "rest_loss"), self.optimizers()):
            loss, _ = self._loss(batch)
            self.manual_backward(loss)
            if self.hparams.clip:
                self.clip_gradients(optimizer, gradient_clip_val=self.hparams.clip, gradient_clip_algorithm="norm")
            optimizer.step()
            optimizer.zero_grad()  # the other optimizer's parameters keep this backward's gradients
            losses[name] = loss
        self.log_dict(losses, sync_dist=True)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        blocks = list(self.blocks.parameters())
        in_blocks = {id(p) for p in blocks}
        rest = [p for p in self.parameters() if id(p) not in in_blocks]
        lr = self.hparams.lr
        return [torch.optim.AdamW(blocks, lr=lr), torch.optim.AdamW(rest, lr=lr)]
