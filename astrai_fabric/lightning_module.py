"""``AstraiLM``: the same model, losses, optimizers and schedules as a ``lightning.LightningModule``.

For ``lightning.Trainer`` users: the Trainer owns the loop, devices and strategy; this module brings AstrAI's model
(from a model or checkpoint directory), the seq/sft loss, ``muon_adamw``/``adamw`` with AstrAI's schedules, a
window dataloader, and ``export_astrai`` to write an AstrAI checkpoint directory that AstrAI and ``astrai-fabric``
load. The training loop of this package (``astrai_fabric.train``) is not used here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from astrai_fabric import assets, hub
from astrai_fabric.checkpoint import (
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    load_checkpoint,
    load_model_weights,
    read_model_config,
    save_checkpoint,
)
from astrai_fabric.checkpoint.gather import gather_state
from astrai_fabric.data import load_window_dataset
from astrai_fabric.losses import moe_load_metrics
from astrai_fabric.model import AutoRegressiveLM
from astrai_fabric.optim import OptimArgs, build_optimizer, resolve_ns_dtype
from astrai_fabric.schedule import build_scheduler
from astrai_fabric.tokenizer import Tokenizer
from astrai_fabric.train.lm import lm_loss


class AstraiLM(L.LightningModule):
    """An AstrAI ``AutoRegressiveLM`` trained with seq or sft next-token loss under a ``lightning.Trainer``.

    Args mirror the CLI's flags of the same names (see ``TrainArgs``); the schedule's length is the Trainer's
    ``estimated_stepping_batches``.
    """

    def __init__(
        self,
        param_path: str,
        train_type: Literal["seq", "sft"] = "seq",
        tokenizer_path: str | None = None,
        optimizer: Literal["muon_adamw", "adamw"] = "muon_adamw",
        max_lr: float = 3e-4,
        weight_decay: float = 0.1,
        schedule_type: Literal["cosine", "sgdr", "wsd"] = "cosine",
        warmup_ratio: float = 0.05,
        min_rate: float | None = None,
        label_smoothing: float = 0.0,
        moe_aux_loss_coef: float = 0.01,
        muon_ns_dtype: Literal["auto", "bfloat16", "float32"] = "auto",
        random_seed: int = 3407,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        directory = hub.resolve_model(param_path, "param_path")  # a Hub id too, fetched or from the cache
        config = read_model_config(directory)  # AstrAI's or Hugging Face's
        torch.manual_seed(random_seed)  # AstrAI's initialisation for this seed when the directory has no weights
        self.model = AutoRegressiveLM(config)
        if (directory / WEIGHTS_FILE).exists() or (directory / WEIGHTS_INDEX_FILE).exists():
            weights = load_checkpoint(directory, load_extra=False)
            load_model_weights(self.model, weights.state_dict, source=directory / WEIGHTS_FILE)
        self.tokenizer = Tokenizer.from_dir(hub.resolve_model(tokenizer_path or param_path, "tokenizer_path"))

    def forward(self, input_ids: Tensor, **kwargs: Any) -> dict[str, Any]:
        return self.model(input_ids, **kwargs)

    def _loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        return lm_loss(self.model, batch, self.hparams.label_smoothing, self.hparams.moe_aux_loss_coef)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss, metrics = self._loss(batch)
        metrics = moe_load_metrics(metrics)  # this micro-batch's load, as AstrAI logs it
        self.log("train_loss", loss, prog_bar=True)
        self.log_dict({f"train_{k}": v for k, v in metrics.items()})
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss, _ = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        ns_dtype = resolve_ns_dtype(hp.muon_ns_dtype, self.device)
        optimizer = build_optimizer(self.model, OptimArgs(hp.optimizer, hp.max_lr, hp.weight_decay, ns_dtype=ns_dtype))
        total_steps = int(self.trainer.estimated_stepping_batches)
        scheduler = build_scheduler(
            optimizer, hp.schedule_type, total_steps, min(int(hp.warmup_ratio * total_steps), total_steps), hp.min_rate
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def dataloader(
        self,
        data_root_path: str,
        window_size: int | None = None,
        batch_size: int = 1,
        stride: int | None = None,
        shuffle: bool = True,
        num_workers: int = 0,
    ) -> DataLoader:
        """Windows of ``data_root_path`` (JSONL or AstrAI bin shards) for this module's train type.

        The Trainer shards it across ranks with its own distributed sampler.
        """
        window_size = window_size or self.model.config.max_position_embeddings
        path = assets.resolve(data_root_path)
        dataset = load_window_dataset(self.hparams.train_type, path, window_size, stride, self.tokenizer)
        return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, num_workers=num_workers)

    def export_astrai(self, directory: str | Path) -> Path:
        """Write the weights as an AstrAI checkpoint directory (with the tokenizer files); every rank must call it
        (sharded weights are gathered), rank 0 writes."""
        directory = Path(directory)
        weights = gather_state(self.model, self.model.state_dict(), keep=self.global_rank == 0)
        if self.global_rank == 0:
            meta = {"train_type": self.hparams.train_type, "lightning_module": dict(self.hparams)}
            files = dict(self.tokenizer.files)
            save_checkpoint(directory, weights, self.model.config.to_dict(), meta=meta, files=files, overwrite=True)
        if self._trainer is not None:
            self.trainer.strategy.barrier()
        return directory
