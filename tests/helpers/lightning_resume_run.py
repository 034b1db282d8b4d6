"""A Lightning fit over a store that logs every training batch, checkpoints after every step and can
SIGKILL itself: what tests/data/test_lightning_resume.py kills and resumes with ``ckpt_path``.

Each training step appends a JSON line (epoch, sample indices, checksum of the augmented image) to the log;
``--kill-at N`` sends SIGKILL at global step N, before it is logged; ``--resume`` fits again from
``last.ckpt``, as a requeued job does."""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import lightning
import torch

from medload.lightning import StoreDataModule

EPOCHS = 2


class Recorder(lightning.LightningModule):
    """One convolution; logs what each training step saw."""

    def __init__(self, log: Path, kill_at: int | None) -> None:
        super().__init__()
        self.net = torch.nn.Conv2d(3, 1, 3, padding=1)
        self.log_path, self.kill_at = log, kill_at

    def training_step(self, batch, batch_idx):
        if self.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        with self.log_path.open("a") as out:
            out.write(json.dumps({"epoch": self.current_epoch, "index": batch["index"].tolist(),
                                  "image": round(float(batch["image"].double().sum()), 3)}) + "\n")
        return self.net(batch["image"]).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = StoreDataModule(args.store, context=1, batch_size=3, num_workers=2, window="soft_tissue", augment=True,
                           val_fraction=0.0, seed=4, labels=False)
    checkpoints = lightning.pytorch.callbacks.ModelCheckpoint(dirpath=args.out, save_last=True, save_top_k=0,
                                                              every_n_train_steps=1)
    trainer = lightning.Trainer(accelerator="cpu", max_epochs=EPOCHS, logger=False, callbacks=[checkpoints],
                                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(Recorder(args.out / "log.jsonl", args.kill_at), datamodule=data,
                ckpt_path=args.out / "last.ckpt" if args.resume else None)


if __name__ == "__main__":
    main()
