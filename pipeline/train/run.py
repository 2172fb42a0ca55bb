"""``python -m pipeline train``: contrastive pretraining (the same as ``launch/pretrain.py``)."""

from __future__ import annotations

from pipeline.train.config import Config

__all__ = ["Config", "run"]


def run(cfg: Config) -> int:
    from pipeline.train.build import build
    from pipeline.train.loop import train

    trainer = build(cfg)
    try:
        return train(trainer)
    finally:
        trainer.close()
