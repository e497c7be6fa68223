"""lm-evaluation-harness on our own model, any architecture we train: ``AstraiFabricLM`` is an ``lm_eval`` language
model, registered as ``astrai_fabric`` when this module is imported; ``run_tasks`` runs tasks through lm-eval's
``simple_evaluate``. The only lm_eval importer (the ``.[eval]`` extra; ``evaluate.run`` imports this module only when
tasks are asked for, and says which extra is missing).

From Python, with lm-eval's own API (lm-eval 0.4.13 has no plugin discovery for its command line)::

    import lm_eval
    from astrai_fabric.evaluate.harness import AstraiFabricLM
    lm = AstraiFabricLM("checkpoints/run/epoch_0_step_100", batch_size=16)
    lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])   # or model="astrai_fabric", model_args="pretrained=..."

Requests are scored as lm-eval's ``hf`` backend scores them on our ``export --format hf`` of the same model (the
tests compare the two): the same tokenisation (the tokenizer's special tokens, none where the text starts with the
prefix token), the empty-context prefix (BOS, else EOS), left truncation to the model's context, greedy decoding cut
at the stop strings and EOS. Batching differs (ours is by length only); results do not depend on it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lm_eval
import torch
import torch.distributed as dist
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from torch import nn
from tqdm import tqdm

from astrai_fabric import hub
from astrai_fabric.checkpoint import load_language_model
from astrai_fabric.errors import UserError
from astrai_fabric.evaluate.perplexity import evaluation_world, right_padded_logprobs
from astrai_fabric.inference import Engine, SamplingParams
from astrai_fabric.tokenizer import Tokenizer

LM_EVAL_VERSION = lm_eval.__version__

LoglikelihoodRequest = tuple[Any, list[int], list[int]]
"""lm-eval's ``(cache key, context ids, continuation ids)``."""


@register_model("astrai_fabric")
class AstraiFabricLM(TemplateLM):
    """Our model under lm-eval: ``pretrained`` is a loaded model or anything ``evaluate`` takes as SRC (a checkpoint,
    a LoRA checkpoint, a Hugging Face directory, a Hub id); ``tokenizer`` a ``Tokenizer`` or its directory (default:
    the model's)."""

    def __init__(
        self,
        pretrained: str | nn.Module,
        tokenizer: str | Tokenizer | None = None,
        batch_size: int | str = 8,
        max_gen_toks: int = 256,
        device: str | None = None,
        dtype: str | torch.dtype | None = None,
        seed: int = 1234,
        progress: bool = True,
        **lm_eval_options: Any,
    ) -> None:
        super().__init__()
        # lm-eval hands every model max_batch_size and the like; our batches are batch_size requests, no search.
        del lm_eval_options
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if isinstance(pretrained, nn.Module):
            model, directory = pretrained, None
        else:
            directory = hub.resolve_model(str(pretrained), "pretrained")
            model = load_language_model(directory, dtype=dtype, command="lm-evaluation-harness")
        if device is not None:
            model = model.to(device)
        self.model = model.eval()
        if isinstance(tokenizer, Tokenizer):
            self.tokenizer = tokenizer
        elif tokenizer is not None or directory is not None:
            self.tokenizer = Tokenizer.from_dir(
                hub.resolve_model(str(tokenizer), "tokenizer") if tokenizer else directory
            )
        else:
            raise UserError("AstraiFabricLM: a model given as a module needs its tokenizer (tokenizer=...)")
        if self.tokenizer.eos_token_id is None and self.tokenizer.bos_token_id is None:
            raise UserError(f"tokenizer {self.tokenizer.directory}: lm-eval needs an eos_token or a bos_token")
        if str(batch_size) == "auto":
            raise UserError("batch_size auto is not supported by astrai_fabric's model: give a number")
        self.batch_size = int(batch_size)
        self._max_gen_toks = int(max_gen_toks)
        self.progress = progress
        self.seed = seed
        """Request i of a generate_until call samples with the seed ``seed + i``."""

    # --- what lm-eval asks of a model --------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # lm-eval splits the documents among ranks itself and gathers their metrics on rank 0 through these: the
    # process group ``torch.distributed`` holds (``evaluate --nprocs``, torchrun, or a program of your own).

    @property
    def rank(self) -> int:
        return evaluation_world()[0]

    @property
    def world_size(self) -> int:
        return evaluation_world()[1]

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(gathered, tensor)
        return torch.stack(gathered) if tensor.dim() == 0 else torch.cat(gathered)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj)  # gloo and nccl alike (gather_object needs the destination's device)
        return gathered if self.rank == dst else None

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        return eos if eos is not None else self.tokenizer.bos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context, and the first rolling window, is conditioned on: BOS, else EOS (as ``hf``)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.model.config.max_position_embeddings

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.directory).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template if chat_template is not False else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.render_chat(chat_history, add_generation_prompt=add_generation_prompt, where="lm-eval")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        if add_special_tokens is None:  # the tokenizer's own special tokens, unless the text starts with the prefix
            prefix = self.tokenizer.decode([self.prefix_token_id], skip_special_tokens=False)
            add_special_tokens = not string.startswith(prefix)
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens)

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    # --- scoring -------------------------------------------------------------------------------------------------

    def _loglikelihood_tokens(
        self, requests: list[LoglikelihoodRequest], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """``(sum of log p(continuation | context), whether greedy decoding gives the continuation)`` per request,
        the context left-truncated so that context and continuation fit ``max_length`` (as ``hf``)."""
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        bar = self._bar(len(requests), "loglikelihood", disable_tqdm)
        for batch in _chunks(order, self.batch_size):
            inputs, targets = [], []
            for i in batch:
                _, context, continuation = requests[i]
                whole = (context + continuation)[-(self.max_length + 1) :]
                inputs.append(whole[:-1])
                targets.append(whole[1:])
            logprobs, greedy = right_padded_logprobs(self.model, inputs, targets, with_greedy=True)
            for i, row_logprobs, row_greedy in zip(batch, logprobs, greedy, strict=True):
                key, _, continuation = requests[i]
                count = len(continuation)
                answer = (float(row_logprobs[-count:].double().sum()), bool(row_greedy[-count:].all()))
                results[i] = answer
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
                bar.update(1)
        bar.close()
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's whole log-likelihood, conditioned on the prefix token, in disjoint windows of
        ``max_length`` with the most context (lm-eval's ``get_rolling_token_windows``)."""
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            rolling = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(lm_utils.make_disjoint_window, rolling):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm), strict=True):
            totals[owner] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each context continued (greedy unless the task asks to sample) until a stop string, EOS or
        ``max_gen_toks``; the text before the first stop string. Requests of one set of generation options are
        batched, the context left-truncated to leave room for ``max_gen_toks``."""
        results: list[str | None] = [None] * len(requests)
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(i)
        bar = self._bar(len(requests), "generate_until", disable_tqdm)
        for members in groups.values():
            options = normalize_gen_kwargs(dict(requests[members[0]].args[1]), self.max_gen_toks)
            until = handle_stop_sequences(options.pop("until", None), eos=eos)
            max_new_tokens = options.pop("max_gen_toks")
            context_limit = self.max_length - max_new_tokens
            if context_limit < 1:
                raise UserError(
                    f"max_gen_toks {max_new_tokens} leaves no room for a context in the model's "
                    f"{self.max_length} positions"
                )
            encoded = {i: self.tok_encode(requests[i].args[0])[-context_limit:] for i in members}
            # One engine for the group: batch_size requests at a time, each leaving as it stops (a stop string in
            # its text, or EOS), request i seeded seed + i whatever runs beside it.
            engine = Engine(self.model, max_num_seqs=self.batch_size, decode=self.tok_decode)
            temperature = float(options.get("temperature", 0.0)) if options.get("do_sample") else 0.0
            ids = {}
            for i in members:
                params = SamplingParams(
                    max_tokens=max_new_tokens,
                    temperature=temperature,
                    top_k=int(options.get("top_k", 0) or 0),
                    top_p=float(options.get("top_p", 1.0)),
                    seed=self.seed + i,
                    stop_token_ids=[self.eot_token_id],
                    stop=[term for term in until if term],
                )
                ids[engine.add_request(encoded[i], params)] = i
            while engine.has_work():
                for completion, _ in engine.step():
                    if completion.finish_reason is None:
                        continue
                    i = ids[completion.request_id]
                    tokens = [t for t in completion.tokens if t != self.eot_token_id]
                    text = postprocess_generated_text(self.tok_decode(tokens), stop=until, think_end_token=None)
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    bar.update(1)
        bar.close()
        return results

    def _bar(self, total: int, what: str, disable: bool) -> tqdm:
        hidden = disable or not self.progress or self.rank != 0
        return tqdm(total=total, desc=what, unit="req", disable=hidden, dynamic_ncols=True)


def _chunks(items: list[int], size: int) -> Iterator[list[int]]:
    for begin in range(0, len(items), size):
        yield items[begin : begin + size]


@functools.cache
def task_manager(include_path: str | None, defaults: bool = True) -> Any:
    """lm-eval's index of task YAMLs: its own (``defaults``) and ``include_path``'s. Built once per process: lm-eval's
    are thousands of files (seconds to read)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=defaults)


def tasks_index(tasks: list[str], include_path: str | None) -> Any:
    """The index that knows ``tasks``: ``include_path``'s alone where it holds them all (no need to read lm-eval's
    own thousands), else lm-eval's with it; tasks neither knows are one line."""
    if include_path is not None:
        own = task_manager(include_path, defaults=False)
        if all(own.match_tasks([task]) for task in tasks):
            return own
    manager = task_manager(include_path)
    unknown = [task for task in tasks if not manager.match_tasks([task])]
    if unknown:
        raise UserError(
            f"tasks: {', '.join(unknown)} not known to lm-eval {LM_EVAL_VERSION} (its registry, and "
            "--include_path where given; `python -m lm_eval ls tasks` lists them)"
        )
    return manager


def _built_in_its_directory(task: str, manager: Any) -> str | Any:
    """``task`` as lm-eval is handed it: by name, or, for a task of a YAML file whose relative ``dataset_path`` or
    ``data_files`` are found beside that file, built there (a ``Task`` loads its data as it is made), so that the
    task runs from any directory. lm-eval hands both paths to ``datasets``, which reads a relative path from the
    current directory, while it reads a task's ``include:`` and ``!function`` files from the YAML's directory: we read
    the data from there too (a task whose paths are found only from the current directory is read from there, as
    before). A group's member tasks keep lm-eval's reading."""
    entry = manager.task_index.get(task)
    if entry is None or entry.yaml_path is None or not isinstance(entry.cfg, dict) or "task" not in entry.cfg:
        return task
    directory = Path(entry.yaml_path).parent
    paths = [entry.cfg.get("dataset_path")]
    kwargs = entry.cfg.get("dataset_kwargs")
    if isinstance(kwargs, dict):
        paths += _flat_paths(kwargs.get("data_files"))
    if not any(isinstance(path, str) and _beside(path, directory) for path in paths):
        return task
    with contextlib.chdir(directory):
        return manager.load([task])["tasks"][task]


def _flat_paths(files: Any) -> list[Any]:
    """``datasets``' ``data_files`` (a path, a list of them, or a split's name to either) as a list of paths."""
    if isinstance(files, list):
        return [path for item in files for path in _flat_paths(item)]
    if isinstance(files, dict):
        return [path for item in files.values() for path in _flat_paths(item)]
    return [files]


def _beside(path: str, directory: Path) -> bool:
    """Whether ``path``, relative, names a file, folder or glob match in ``directory``."""
    if "://" in path or Path(path).is_absolute():
        return False
    try:
        return (directory / path).exists() or any(directory.glob(path))
    except (OSError, ValueError, NotImplementedError):  # a pattern glob refuses (".." and the like)
        return False


def run_tasks(lm: AstraiFabricLM, tasks: list[str], options: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` of ``lm`` on ``tasks``: ``{"results": {task: {metric: value}}, "samples": ...,
    "versions": ..., "n-shot": ...}`` as lm-eval returns it, the non-JSON parts left out. ``options``: num_fewshot,
    limit, apply_chat_template, log_samples, include_path, seed."""
    include_path = options.get("include_path")
    if include_path is not None and not Path(include_path).is_dir():
        raise UserError(f"include_path {include_path}: not a directory of task YAML files")
    # In full: a task's YAML path is then its directory's whatever the current one (_built_in_its_directory).
    manager = tasks_index(tasks, None if include_path is None else str(Path(include_path).resolve()))
    seed = options["seed"]
    try:
        output = lm_eval.simple_evaluate(
            model=lm,
            tasks=[_built_in_its_directory(task, manager) for task in tasks],
            num_fewshot=options.get("num_fewshot"),
            limit=options.get("limit"),
            apply_chat_template=options.get("apply_chat_template", False),
            log_samples=options.get("log_samples", False),
            task_manager=manager,
            fewshot_random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            bootstrap_iters=100000,
        )
    except FileNotFoundError as err:  # a local task's data file (datasets' words name it)
        raise UserError(
            f"tasks {','.join(tasks)}: {err} (a task's relative data_files are read from its YAML file's directory, "
            "else from the current directory)"
        ) from None
    if output is None:  # lm-eval returns None on ranks other than 0
        return {}
    kept = {key: output[key] for key in ("results", "versions", "n-shot", "higher_is_better") if key in output}
    if options.get("log_samples"):
        kept["samples"] = output.get("samples", {})
    return _jsonable(kept)


def _jsonable(value: Any) -> Any:
    """lm-eval's results as plain JSON (it holds numpy numbers and the odd object): numbers stay numbers, anything
    else becomes its text."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if hasattr(value, "item"):
        return value.item()
    return str(value)
