"""The generation engine: continuous batching over a paged KV cache with prefix reuse. Nothing else generates.

- ``Engine`` (``engine``): requests (token ids, ``SamplingParams``) join the running batch at every step and leave it
  the moment they finish. A step decodes one token for every request past its prompt, then prefills the next chunk
  of the prompts being read (at most ``max_prefill_tokens`` positions a step, so a long prompt does not stall the
  others' decoding), then samples for each request whose logits are ready.
- The KV cache (``paged_cache``): one pool of fixed-size blocks per layer, a block table per request. A request is
  admitted only when the pool can hold all it may write (its prompt and ``max_tokens``), so nothing is ever evicted
  from a running request; one that can never fit is refused when added, naming the limits. The model attends
  through its ``kv_cache`` seam: each forward's ``BatchView`` gathers the requests' past keys and values from their
  blocks and the model runs its own exact attention (SDPA, soft-capping, sliding windows, GQA, MLA) over them.
- Prefix reuse (``blocks``): a full block is found again by its tokens (a hash chain, compared exactly), held by
  several requests at once and, once free, kept until the pool needs it (least recently used first). A request's
  ``n`` completions share its prompt's blocks: the prompt is prefilled once.
- Sampling (``sampling``): per request, from its own row of logits with its own seeded generator.
"""

from astrai_fabric.inference.engine import Completion, Engine
from astrai_fabric.inference.sampling import RequestError, SamplingParams, TokenLogprobs

__all__ = ["Completion", "Engine", "RequestError", "SamplingParams", "TokenLogprobs"]
