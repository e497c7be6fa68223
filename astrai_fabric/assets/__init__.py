"""Tiny assets shipped inside the package, so an installed CLI finds them without a download.

``tiny/`` is a model directory in AstrAI's layout (``config.json``, ``tokenizer.json``, ``tokenizer_config.json``;
no weights: training starts from AstrAI's initialisation); ``data/seq`` holds plain text and ``data/sft`` chat
``messages`` as JSONL. ``build.py`` regenerates them; README.md gives their provenance.
"""

from pathlib import Path

ASSETS_DIR = Path(__file__).parent
TINY_MODEL_DIR = ASSETS_DIR / "tiny"
SEQ_DATA_DIR = ASSETS_DIR / "data" / "seq"
SFT_DATA_DIR = ASSETS_DIR / "data" / "sft"

BUNDLED_PREFIX = "bundled:"


def resolve(path: str | Path) -> Path:
    """``bundled:NAME`` → the shipped asset ``NAME`` (``bundled:tiny``, ``bundled:data/sft``); other paths as given."""
    text = str(path)
    return ASSETS_DIR / text.removeprefix(BUNDLED_PREFIX) if text.startswith(BUNDLED_PREFIX) else Path(text)
