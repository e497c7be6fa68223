"""Every parallel dimension, applied to a model from outside: the mesh of them all (``mesh``: one layout, built
once), FSDP2, tensor, context, expert and pipeline parallelism applied to a model (``parallelize``), and the
collectives behind the model's seams: a ``ContextGroup`` for its attention (``context``: Ulysses' all-to-alls) and an
``ExpertGroup`` for its MoE layers (``expert``). The model (``model/``) imports no ``torch.distributed``: it asks its
seams, which this package fills (tests/test_layout.py holds it so). What combines is ``config.combinations``'."""
