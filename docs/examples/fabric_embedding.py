"""Train the bundled tiny model with a Fabric you build and launch yourself (2 CPU processes, DDP).

python docs/examples/fabric_embedding.py [OUT_DIR]
"""

import sys

import lightning as L
from lightning.fabric.loggers import CSVLogger

from astrai_fabric.checkpoint import find_latest_checkpoint, load_checkpoint
from astrai_fabric.config.train import TrainArgs
from astrai_fabric.train import train


def main(fabric: L.Fabric, out_dir: str) -> None:
    args = TrainArgs(
        train_type="sft",
        param_path="bundled:tiny",
        data_root_path="bundled:data/sft",
        ckpt_dir=out_dir,
        window_size=64,
        batch_per_device=4,
        max_steps=4,
        num_workers=0,
    )
    history = train(fabric, args)  # this Fabric's strategy, devices and loggers; nothing is launched again
    fabric.print(f"trained {len(history)} steps, final loss {history[-1]['loss']:.3f}")
    if fabric.global_rank == 0:
        checkpoint = load_checkpoint(find_latest_checkpoint(out_dir))
        step = checkpoint.meta["resume_position"]["optimizer_step"]
        print(f"AstrAI checkpoint {checkpoint.path}: {len(checkpoint.state_dict)} tensors, step {step}")


if __name__ == "__main__":
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "checkpoints/embedded"
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp", loggers=CSVLogger(out_dir, name="logs"))
    fabric.launch(main, out_dir)
