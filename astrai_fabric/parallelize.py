"""``astrai_fabric.parallelize.parallelize``: the name programs give ``ModelParallelStrategy(parallelize_fn=...)``
(docs/embedding.md), kept where they find it; the function is ``parallel.parallelize``'s."""

from astrai_fabric.parallel.parallelize import parallelize

__all__ = ["parallelize"]
