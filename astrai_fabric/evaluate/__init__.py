"""``astrai-fabric evaluate``: what training did, measured.

- ``run``: SRC (a model, or each checkpoint of a run) loaded and evaluated, results printed, stored and skipped
  when done
- ``perplexity``: loss and perplexity on held-out data, read and scored as training reads it, with a bootstrap
  interval
- ``harness``: lm-evaluation-harness tasks on our model (``AstraiFabricLM``, registered as ``astrai_fabric``); the
  only lm_eval importer (the ``.[eval]`` extra)
- ``results``: the ``eval/*.json`` files in each checkpoint (light: ``astrai-fabric plot`` reads them)

Nothing is imported here, so that ``results`` loads without torch.
"""
