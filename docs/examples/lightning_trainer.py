"""Train the bundled tiny model with a lightning.Trainer, then export an AstrAI checkpoint.

python docs/examples/lightning_trainer.py [OUT_DIR]
"""

import sys

import lightning as L

from astrai_fabric.checkpoint import load_checkpoint
from astrai_fabric.lightning_module import AstraiLM


def main(out_dir: str) -> None:
    module = AstraiLM(param_path="bundled:tiny", train_type="seq", max_lr=1e-3)
    train_loader = module.dataloader("bundled:data/seq", window_size=64, batch_size=8)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=5,
        gradient_clip_val=1.0,
        default_root_dir=out_dir,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(module, train_loader)
    exported = module.export_astrai(f"{out_dir}/astrai")  # loads in AstrAI and in astrai-fabric
    checkpoint = load_checkpoint(exported)
    print(f"AstrAI checkpoint {exported}: {len(checkpoint.state_dict)} tensors ({checkpoint.meta['train_type']})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "checkpoints/lightning")
