"""The embedding examples in docs/embedding.md run as written and their checkpoints load."""

import subprocess
import sys
from pathlib import Path

import pytest

from astrai_fabric.checkpoint import find_latest_checkpoint, load_checkpoint, load_model

ROOT = Path(__file__).parents[1]
EXAMPLES = ROOT / "docs" / "examples"


@pytest.mark.parametrize("example", ["fabric_embedding.py", "lightning_trainer.py"])
def test_the_docs_show_the_examples_verbatim(example):
    assert (EXAMPLES / example).read_text() in (ROOT / "docs" / "embedding.md").read_text()


def run_example(name: str, out: Path) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), str(out)],
        capture_output=True,
        text=True,
        env={"OMP_NUM_THREADS": "1", "PATH": str(Path(sys.executable).parent)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow
def test_fabric_embedding_example(tmp_path):
    out = run_example("fabric_embedding.py", tmp_path)
    assert "trained 4 steps" in out
    checkpoint = load_checkpoint(find_latest_checkpoint(tmp_path))
    assert checkpoint.path.name == "epoch_0_step_4" and checkpoint.meta["train_type"] == "sft"
    (metrics,) = tmp_path.glob("logs/version_*/metrics.csv")  # the caller's CSV logger got every step
    assert len(metrics.read_text().splitlines()) == 1 + 4


@pytest.mark.slow
def test_lightning_trainer_example(tmp_path):
    out = run_example("lightning_trainer.py", tmp_path)
    assert "AstrAI checkpoint" in out
    model = load_model(tmp_path / "astrai")
    assert model.lm_head.weight is model.embed_tokens.weight  # tied, as the bundled config says
