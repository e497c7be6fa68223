"""Training data: AstrAI bin shards and JSONL, windowed datasets, a resumable distributed sampler.

Knows nothing of the model or Fabric.
"""

from astrai_fabric.data.datasets import TokenStream, WindowDataset, load_window_dataset
from astrai_fabric.data.sampler import ResumableSampler

__all__ = ["ResumableSampler", "TokenStream", "WindowDataset", "load_window_dataset"]
