"""The fuzz tier: hostile inputs of every kind the CLI reads (tests/fuzz_inputs.py's strategies: model and Hugging
Face config.json, tokenizer_config.json and chat templates, checkpoint meta.json, adapter_config.json, recipes, JSONL
records, bin-shard meta.json, metric.jsonl, stored eval results, chat's stdin, dataset cards, CSV/parquet/arrow
files, Hub cache layouts, QLoRA and reward-model records, cluster layouts for the dry run, sharded optimizer
states), each through the real CLI entry point in a forked child, must keep the error promise
(``fuzz_inputs.broken_promise``).

CI runs a fixed seed and a bounded budget: ``CI_PAIRS_DEFAULT`` pairs of examples per kind (``CI_PAIRS`` for the
newer ones; each pair at once, one per core), no example database. ``make fuzz FUZZ_SECONDS=600`` (or
``FUZZ_EXAMPLES=500`` pairs per kind) gives each kind its share of the time (``fuzz``): round after round of
``ROUND`` pairs, each round's seed its own, until the share is spent; it stops at the first broken promise, shrunk.
``FUZZ_SEED=N`` repeats a run, ``FUZZ_KEEP_GOING=1`` lists every broken promise at the end instead (unshrunk).
What it finds becomes a case of tests/test_fuzz_found.py (an ``xfail(strict=True)`` case while the package fails
it) and, once fixed, a table case of tests/test_hostile_input.py.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from fuzz_inputs import (
    adapter_configs,
    chat_stdins,
    check_all,
    checkpoint_metas,
    dataset_cards,
    derived,
    eval_results,
    hf_configs,
    hub_caches,
    jsonl_records,
    layouts,
    metric_histories,
    model_configs,
    qlora_metas,
    recipes,
    reward_model_records,
    session,
    shard_metas,
    sharded_states,
    snapshot,
    table_files,
    tokenizer_configs,
)
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from astrai_fabric.assets import TINY_MODEL_DIR, resolve

CI_PAIRS_DEFAULT = 12
"""Per kind: the first 9 kinds x 12 pairs x 2 = 216 examples (and the newer kinds' ``CI_PAIRS``: 28 more)."""
CI_PAIRS = {"eval-result": 1, "chat-stdin": 2, "dataset-card": 1, "table-file": 1, "hub-cache": 2, "qlora-meta": 1,
            "reward-model": 1, "layout": 3, "sharded-state": 2}  # fmt: skip
"""The kinds of rounds 4 and 5 in CI: a handful of examples each (their own bases cost a few seconds to make)."""
CI_SEED = 20231
ROUND = 25
"""Pairs per seed when ``FUZZ_SECONDS`` asks for rounds."""
SEED_STEP = 1000
"""How far each round's seed is from the previous one's (a kind's first seed is ``FUZZ_SEED`` + its index)."""
KINDS = ("model-config", "hf-config", "tokenizer-config", "checkpoint-meta", "adapter-config", "recipe", "jsonl",
         "shard-meta", "metric-jsonl", "eval-result", "chat-stdin", "dataset-card", "table-file", "hub-cache",
         "qlora-meta", "reward-model", "layout", "sharded-state")  # fmt: skip


NEEDS = {"eval-result": ("eck",), "qlora-meta": ("qck",), "reward-model": ("rck",), "sharded-state": ("sck",)}
"""The kinds that read a base of ``fuzz_inputs.DERIVED``, made on first use."""


def strategy(kind: str, workspace) -> st.SearchStrategy:
    read = lambda name: json.loads((workspace / name).read_text())  # noqa: E731
    make = {
        "model-config": lambda: model_configs(),
        "hf-config": lambda: hf_configs(read("hf/config.json")),
        "tokenizer-config": lambda: tokenizer_configs(
            read("tiny/tokenizer_config.json"), read("hf/tokenizer_config.json")
        ),
        "checkpoint-meta": lambda: checkpoint_metas(read("ck/meta.json"), read("lck/meta.json")),
        "adapter-config": lambda: adapter_configs(read("lck/adapter_config.json")),
        "recipe": lambda: recipes(),
        "jsonl": lambda: jsonl_records(workspace),
        "shard-meta": lambda: shard_metas(workspace),
        "metric-jsonl": lambda: metric_histories(workspace),
        "eval-result": lambda: eval_results(workspace),
        "chat-stdin": lambda: chat_stdins(),
        "dataset-card": lambda: dataset_cards(),
        "table-file": lambda: table_files(),
        "hub-cache": lambda: hub_caches(workspace),
        "qlora-meta": lambda: qlora_metas(read("qck/meta.json")),
        "reward-model": lambda: reward_model_records(read("rck/config.json"), read("rck/meta.json")),
        "layout": lambda: layouts(),
        "sharded-state": lambda: sharded_states(workspace),
    }
    derived(workspace, *NEEDS.get(kind, ()))
    return make[kind]()


@pytest.fixture(scope="module", autouse=True)
def bundled_assets_unchanged():
    before = snapshot(resolve("bundled:data")), snapshot(TINY_MODEL_DIR)
    yield
    assert (snapshot(resolve("bundled:data")), snapshot(TINY_MODEL_DIR)) == before


@dataclass
class Tally:
    """What one kind's fuzzing did: rounds started, pairs run (drawn after the time was spent: skipped), and the
    seed of each round."""

    rounds: int = 0
    pairs: int = 0
    seeds: list[int] = field(default_factory=list)
    failed: bool = False
    """A pair broke the promise: Hypothesis shrinks and replays it, and those runs go on past the time."""


def fuzz(
    name: str,
    examples: st.SearchStrategy,
    check_pair: Callable[[Any], None],
    seconds: float,
    pairs_per_round: int,
    first_seed: int,
    clock: Callable[[], float] = time.monotonic,
) -> Tally:
    """Draw ``pairs_per_round`` examples from ``examples`` and give each to ``check_pair`` (which raises on a broken
    promise, so that Hypothesis shrinks it): one round when ``seconds`` is 0, else round after round, the seed one
    ``SEED_STEP`` further each round, until ``seconds`` are spent (by ``clock``)."""
    stop_at = clock() + seconds
    tally = Tally()
    options = settings(
        max_examples=pairs_per_round, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )

    def run_pair(pair: Any) -> None:
        if seconds and clock() > stop_at and not tally.failed:  # skipped once spent, unless shrinking
            return
        tally.pairs += 1
        try:
            check_pair(pair)
        except BaseException:
            tally.failed = True
            raise

    for i in itertools.count() if seconds else range(1):
        round_seed = first_seed + SEED_STEP * i
        print(f"{name}: round {i}, seed {round_seed}")

        # A new function each round: Hypothesis refuses a second settings object on one already decorated.
        @seed(round_seed)
        @options
        @given(examples)
        def one_round(pair: Any) -> None:
            run_pair(pair)

        tally.rounds += 1
        tally.seeds.append(round_seed)
        one_round()
        if not seconds or clock() > stop_at:
            break
    print(f"{name}: {tally.rounds} round(s), {tally.pairs} pair(s) run ({2 * tally.pairs} examples)")
    return tally


@pytest.mark.parametrize("kind", KINDS)
def test_hostile_input_keeps_the_error_promise(kind):
    _, workspace = session()
    seconds = float(os.environ.get("FUZZ_SECONDS") or 0) / len(KINDS)
    pairs = int(os.environ.get("FUZZ_EXAMPLES") or (ROUND if seconds else CI_PAIRS.get(kind, CI_PAIRS_DEFAULT)))
    fuzzing = bool(seconds or os.environ.get("FUZZ_EXAMPLES"))
    first_seed = int(os.environ.get("FUZZ_SEED") or (random.randrange(2**32) if fuzzing else CI_SEED))
    keep_going = os.environ.get("FUZZ_KEEP_GOING") == "1"
    examples = st.tuples(strategy(kind, workspace), strategy(kind, workspace))  # first: it may add a base
    workspace_before = snapshot(workspace)
    counter, broken = itertools.count(), []

    def check_pair(pair):
        problems = [p for p in check_all(list(pair), [f"{kind}-{next(counter)}" for _ in pair]) if p]
        if problems and keep_going:
            broken.extend(problems)
            return
        assert not problems, "\n\n".join(problems)

    print(f"{kind}: FUZZ_SEED={first_seed}")
    fuzz(kind, examples, check_pair, seconds, pairs, first_seed + KINDS.index(kind))
    assert snapshot(workspace) == workspace_before  # nothing wrote through a path into the shared bases
    assert not broken, f"{len(broken)} broken promise(s):\n\n" + "\n\n".join(broken)


def test_the_timed_mode_fuzzes_every_kind_round_after_round():
    """Two cheap kinds under a budget of 2.5 rounds each: each runs 3 rounds (the third starts in time, none
    after), each round's seed and examples its own; the same first seed draws the same examples again. Time is a
    clock each pair advances (the machine's would count Hypothesis's own start-up, longer on a loaded machine)."""
    round_s, pairs_per_round = 0.4, 2
    examples = st.integers(0, 2**62)
    drawn: dict[str, list] = {"a": [], "b": []}
    now = [0.0]

    def check(name: str) -> Callable[[int], None]:
        def spend(x: int) -> None:
            drawn[name].append(x)
            now[0] += round_s / pairs_per_round

        return spend

    tallies = [
        fuzz(name, examples, check(name), 2.5 * round_s, pairs_per_round, 7 + index, clock=lambda: now[0])
        for index, name in enumerate(drawn)
    ]
    assert [t.rounds for t in tallies] == [3, 3]
    assert [len(set(t.seeds)) for t in tallies] == [3, 3]
    assert all(values[:2] != values[2:4] for values in drawn.values())  # rounds 0 and 1 drew different pairs
    again = []
    fuzz("a", examples, again.append, seconds=0, pairs_per_round=pairs_per_round, first_seed=7)
    assert again == drawn["a"][:2]  # FUZZ_SEED repeats a run


def test_a_broken_promise_found_as_the_time_runs_out_is_shrunk_and_reported():
    """The pair that fails is run again while Hypothesis shrinks and replays it, past the time: the failure is
    reported as it is (skipping those runs made Hypothesis call it flaky)."""

    calls = []

    def always_broken(pair: Any) -> None:
        if not calls:
            time.sleep(0.35)  # the first pair runs in time and ends past it
        calls.append(pair)
        raise AssertionError(f"broken: {pair}")

    with pytest.raises(AssertionError, match="broken"):
        fuzz("c", st.integers(0, 9), always_broken, seconds=0.3, pairs_per_round=2, first_seed=1)
    assert len(calls) > 1  # shrunk and replayed
