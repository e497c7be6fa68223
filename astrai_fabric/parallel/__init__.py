"""Every parallel dimension, applied to a model from outside: the mesh of them all (``mesh``: one layout, built
once), FSDP2, tensor, context, expert and pipeline parallelism applied to a model (``parallelize``), and the
collectives behind the model's seams: a ``ContextGroup`` for its attention (``context``: Ulysses' all-to-alls) and an
``ExpertGroup`` for its MoE layers (``expert``). The model (``model/``) imports no ``torch.distributed``: it asks its
seams, which this package fills (tests/test_layout.py holds it so). What combines is ``config.combinations``'.

Scale factors that cancel across files, so that every layout's gradient is one process's (each applied where it
arises; here is why they meet):

- context parallelism: each rank of a group of C holds the whole window's loss (the output gathered,
  ``ContextGroup.gather_positions``), so the gather's adjoint sums C ranks' gradients into each position: C times
  one loss's; FSDP shards over shard x context and averages its reduce-scatter over all of them, dividing by C
  again (``context``'s docstring);
- the pipeline: the schedule's loss function divides each micro-batch's loss by the micro-batches, as
  ``train_step`` divides by ``grad_accum_steps``, and does not scale the gradients again (``scale_grads=False``);
  the window's loss, on the last stage's ranks only, is multiplied by the micro-batches (back to a sum, as the eager
  window's) and by the pipeline's ranks, the others giving 0, so that ``train_step``'s mean over every rank is the
  last stage's (``parallel.pipeline.Pipeline.train_window``);
- expert parallelism: an expert's gradient arrives summed over its group's tokens routed to it (the exchange's
  adjoint), and FSDP reduces the experts over the shards the groups leave, so the mesh's own average (by its size)
  is replaced by a division by every data rank (``set_gradient_divide_factor`` in ``parallelize``): each expert's
  gradient is then the whole batch's mean, as the dense layers' are.
"""
