"""Hub model ids (``astrai_fabric/hub.py``) against the local stand-in for the Hub (``hub_stand_in.py``: which
endpoints it serves and why it stands in): ``download`` then offline training, generate, chat, evaluate and export
from an id, ``org/name@commit`` recorded in meta.json and a LoRA checkpoint's base pointer (which loads again
offline), the messages (offline with no cached copy, gated, pickled weights only, a missing path that looks like an
id, an unknown revision, an unreachable Hub), each one line."""

import fnmatch
import io
import json
import time
from pathlib import Path

import pytest
import torch
from hub_stand_in import go_offline, serving
from spawn import run_ranks

from astrai_fabric import dataset_card, hub
from astrai_fabric.assets import TINY_MODEL_DIR
from astrai_fabric.checkpoint import LORA_BASE_KEY, save_checkpoint
from astrai_fabric.cli import main
from astrai_fabric.config import ModelConfig
from astrai_fabric.errors import UserError
from astrai_fabric.export import export
from astrai_fabric.model import AutoRegressiveLM

REPO = "org/tiny"


@pytest.fixture(scope="module")
def model_files(tmp_path_factory) -> dict[str, bytes]:
    """A small Hugging Face directory (the bundled tokenizer, random weights, exported with --format hf), plus the
    pickled copy of its weights many repositories also hold, which must never be fetched."""
    root = tmp_path_factory.mktemp("hub_repo")
    fields = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    fields.pop("model_type")
    fields.update(hidden_size=32, num_hidden_layers=2, intermediate_size=64)
    torch.manual_seed(0)
    model = AutoRegressiveLM(ModelConfig(**fields))
    tokenizer = {name: TINY_MODEL_DIR / name for name in ("tokenizer.json", "tokenizer_config.json")}
    save_checkpoint(root / "ckpt", model.state_dict(), model.config.to_dict(), files=tokenizer)
    export(root / "ckpt", root / "hf", "hf")
    files = {path.name: path.read_bytes() for path in (root / "hf").iterdir()}
    return {**files, "pytorch_model.bin": b"a pickle", "README.md": b"# tiny\n", "original/consolidated.pth": b"x"}


@pytest.fixture
def stand_in(monkeypatch, tmp_path, model_files):
    with serving(monkeypatch, tmp_path / "hf_home") as server:
        server.commit = server.add(REPO, model_files)
        yield server
        assert server.unexpected == []  # the stand-in answers every request huggingface_hub made


def train_argv(train_type: str, ckpt_dir: Path, *extra: str) -> list[str]:
    data = {"seq": "bundled:data/seq", "sft": "bundled:data/sft"}[train_type]
    return [
        train_type,
        "--param_path",
        REPO,
        "--data_root_path",
        data,
        "--window_size",
        "16",
        "--batch_per_device",
        "2",
        "--grad_accum_steps",
        "1",
        "--parallel_mode",
        "none",
        "--num_workers",
        "0",
        "--loggers",
        "[]",
        "--ckpt_dir",
        str(ckpt_dir),
        "--ckpt_interval",
        "1",
        "--max_steps",
        "1",
        *extra,
    ]


def error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("astrai-fabric: error: "), lines
    return lines[0]


def test_download_then_offline_training_generate_and_export_from_an_id(stand_in, monkeypatch, tmp_path, capsys):
    assert main(["download", REPO]) == 0
    snapshot = hub.cache_dir() / "models--org--tiny" / "snapshots" / stand_in.commit
    assert f"downloaded {REPO}@{stand_in.commit} -> {snapshot}" in capsys.readouterr().out
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    )  # only what a run reads: no pickle, no README, nothing from a subfolder
    assert not any("pytorch_model.bin" in r or "original/" in r or "README" in r for r in stand_in.requests)

    go_offline(monkeypatch, stand_in)  # HF_HUB_OFFLINE=1, and the stand-in no longer answers
    assert main(train_argv("seq", tmp_path / "run")) == 0
    meta = json.loads((tmp_path / "run" / "epoch_0_step_1" / "meta.json").read_text())
    assert meta["param_path"] == f"{REPO}@{stand_in.commit}"  # portable: not this machine's cache path
    assert f"param_path: {REPO}@{stand_in.commit}" in (tmp_path / "run" / "recipe.yaml").read_text()

    assert (
        main(["generate", "--param_path", REPO, "--chat", "false", "--prompt", "In the", "--max_new_tokens", "2"]) == 0
    )
    capsys.readouterr()
    stdin = io.TextIOWrapper(io.BytesIO(b"In the\n/exit\n"))  # chat reads bytes: sys.stdin.buffer
    monkeypatch.setattr("sys.stdin", stdin)  # chat reads its model the same way
    assert main(["chat", REPO, "--template", "false", "--max_new_tokens", "2", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.count("\n") == 1  # one reply, streamed, then its newline
    from astrai_fabric.lightning_module import AstraiLM  # the Lightning app reads ids as the CLI does

    assert AstraiLM(param_path=REPO).tokenizer.directory == snapshot
    (tmp_path / "held_out.jsonl").write_text('{"text": "In the beginning God created the heaven"}\n')
    capsys.readouterr()
    assert (
        main(
            [
                "evaluate",
                REPO,
                "--data_root_path",
                str(tmp_path / "held_out.jsonl"),
                "--perplexity_unit",
                "records",
                "--output",
                str(tmp_path / "eval.json"),
            ]
        )
        == 0
    )
    assert f"[1/1] {REPO}@{stand_in.commit}" in capsys.readouterr().out  # named portably; nothing stored in the cache
    assert not (snapshot / "eval").exists() and json.loads((tmp_path / "eval.json").read_text())["results"]
    monkeypatch.chdir(tmp_path)
    assert main(["export", REPO, "--format", "hf"]) == 0
    assert (tmp_path / "tiny_hf" / "model.safetensors").is_file()  # here, named after the repository
    assert main(["export", f"{REPO}@{stand_in.commit}", "--out", str(tmp_path / "astrai")]) == 0
    assert (tmp_path / "astrai" / "model.safetensors").is_file()


def test_a_lora_checkpoint_of_an_id_points_to_org_name_at_commit_and_loads_offline(stand_in, monkeypatch, tmp_path):
    assert main(train_argv("sft", tmp_path / "lora", "--lora_r", "4")) == 0  # online: fetched on the way
    checkpoint = tmp_path / "lora" / "epoch_0_step_1"
    pointer = json.loads((checkpoint / "meta.json").read_text())[LORA_BASE_KEY]
    assert (pointer["path"], pointer["absolute"], pointer["hub"]) == (None, None, f"{REPO}@{stand_in.commit}")
    assert set(pointer["sha256"]) == {"model.safetensors"}  # the hash check of the base is kept

    go_offline(monkeypatch, stand_in)
    argv = ["generate", "--param_path", str(checkpoint), "--chat", "false", "--prompt", "In", "--max_new_tokens", "1"]
    assert main(argv) == 0  # the base resolved again, from the cache
    assert main(["export", str(checkpoint), "--format", "peft", "--out", str(tmp_path / "peft")]) == 0
    adapter_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    pin = adapter_config["base_model_name_or_path"], adapter_config.get("revision")
    assert pin == (REPO, stand_in.commit)  # PEFT's spelling of org/name@commit: not this machine's cache path
    base = hub.cache_dir() / "models--org--tiny" / "snapshots" / stand_in.commit / "model.safetensors"
    real = base.resolve()
    real.chmod(0o644)
    real.write_bytes(real.read_bytes()[:-4] + b"\0\0\0\0")  # another base under the same name
    assert main(argv) == 2


def two_ranks_worker(ckpt_dir: str) -> None:
    """One rank of a 2-process ddp run from the id (the launcher's environment is set: ``spawn.run_ranks``)."""
    assert main(train_argv("seq", Path(ckpt_dir), "--nprocs", "2", "--parallel_mode", "ddp")) == 0


@pytest.mark.slow
def test_every_rank_trains_from_the_commit_rank_zero_pinned_and_only_it_asks_the_hub(stand_in, tmp_path):
    run_ranks(two_ranks_worker, 2, str(tmp_path / "ddp"))
    meta = json.loads((tmp_path / "ddp" / "epoch_0_step_1" / "meta.json").read_text())
    assert meta["param_path"] == f"{REPO}@{stand_in.commit}"
    # rank 0's command line pinned main (repo_info, then snapshot_download's own) and fetched once; rank 1 asked
    # nothing: the pin came from rank 0 and its files from the cache (a second process would double these)
    assert [r for r in stand_in.requests if "/revision/" in r] == [f"GET /api/models/{REPO}/revision/main"] * 2
    assert len([r for r in stand_in.requests if r.startswith("GET /org/tiny/resolve/")]) == 5


def test_a_revision_is_resolved_and_recorded_by_its_commit(stand_in, capsys):
    v1 = stand_in.add(REPO, {"config.json": (TINY_MODEL_DIR / "config.json").read_bytes()}, revision="v1")
    assert main(["download", f"{REPO}@v1"]) == 0
    assert f"downloaded {REPO}@{v1} ->" in capsys.readouterr().out
    assert main(["download", REPO, "--revision", "v1", "--local_dir", str(hub.cache_dir().parent / "copy")]) == 0
    assert (hub.cache_dir().parent / "copy" / "config.json").read_bytes() == (
        TINY_MODEL_DIR / "config.json"
    ).read_bytes()
    assert hub.recorded(f"{REPO}@v1") == f"{REPO}@{v1}"
    assert hub.resolve_model(f"{REPO}@{v1}").name == v1
    capsys.readouterr()
    assert main(["download", f"{REPO}@nope"]) == 2
    assert "param_path" not in (line := error_line(capsys)) and f"{REPO} has no revision 'nope'" in line
    assert main(["download", "./org/tiny"]) == 2
    assert "download './org/tiny': expected a Hub model id" in error_line(capsys)
    assert main(["download", f"{REPO}@v1", "--revision", "v2"]) == 2
    assert "--revision v2 contradicts the @v1 it names" in error_line(capsys)


def test_online_the_hub_rewrites_a_tampered_ref_but_a_snapshot_file_linking_out_is_refused(stand_in, capsys):
    """Online, the branch's commit comes from the Hub (huggingface_hub writes it over whatever ``refs/main`` held);
    the files already in the snapshot are kept as they are by huggingface_hub, so they are checked as offline: a
    link out of the repository's folder is refused, the model's and a dataset card's (before the card is read)."""
    assert main(["download", REPO]) == 0
    folder = hub.cache_dir() / "models--org--tiny"
    (folder / "refs" / "main").write_text("../../../../outside/m")
    assert main(["download", REPO]) == 0
    assert (folder / "refs" / "main").read_text() == stand_in.commit
    config = folder / "snapshots" / stand_in.commit / "config.json"
    outside = hub.cache_dir().parent / "outside.json"
    outside.write_bytes(config.read_bytes())
    config.unlink()
    config.symlink_to(outside)
    capsys.readouterr()
    for argv in (["download", REPO], ["generate", "--param_path", REPO, "--prompt", "x"]):
        assert main(argv) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]  # download: progress too
        assert len(errors) == 1 and f"{config} links to {outside}, outside the repository's folder" in errors[0]

    card = "---\nconfigs:\n- config_name: default\n  data_files: data/*.jsonl\n---\n"
    stand_in.add("org/texts", {"README.md": card.encode(), "data/a.jsonl": b'{"text": "a"}\n'}, repo_type="dataset")
    texts = hub.HubId.parse("org/texts")
    snapshot = hub.snapshot(texts, "data_root_path", repo_type="dataset")
    outside.write_text("---\nconfigs: 3\n---\n")  # read, it would be refused for what it holds
    (snapshot / "README.md").unlink()
    (snapshot / "README.md").symlink_to(outside)
    with pytest.raises(UserError, match=r"README\.md links to .*outside\.json, outside the repository's folder"):
        hub.snapshot(texts, "data_root_path", repo_type="dataset")


def test_hub_mistakes_are_one_line_each(stand_in, monkeypatch, model_files, capsys):
    def refused(param_path: str) -> str:
        started = time.monotonic()
        assert main(["generate", "--param_path", param_path, "--prompt", "x"]) == 2
        assert time.monotonic() - started < 10  # no retry loop
        return error_line(capsys)

    stand_in.add("org/gated", model_files, gated=True)
    assert "the Hub repository org/gated is gated or private" in refused("org/gated")
    monkeypatch.setenv("HF_TOKEN", "hf_not_granted")
    line = refused("org/gated")
    assert "HTTP 403" in line and "set HF_TOKEN to a token with access" in line
    monkeypatch.delenv("HF_TOKEN")

    pickled = {"config.json": model_files["config.json"], "pytorch_model.bin": b"a pickle"}
    stand_in.add("org/pickled", pickled)
    assert "holds its weights only as pickled files (pytorch_model.bin)" in refused("org/pickled")
    assert not hub.cache_dir().joinpath("models--org--pickled").exists()  # refused before anything is fetched

    line = refused("models/missing")  # a path that is not there, or a repository that is not either
    assert "param_path models/missing: no such directory here, and no model repository models/missing" in line

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    assert "the Hub (http://127.0.0.1:9) cannot be reached" in refused("org/elsewhere")

    go_offline(monkeypatch, stand_in)
    line = refused("org/never-downloaded")
    assert "HF_HUB_OFFLINE=1 with no cached copy of the Hub model org/never-downloaded" in line
    assert "`astrai-fabric download org/never-downloaded` while online, or unset HF_HUB_OFFLINE" in line


def test_a_dry_run_downloads_nothing_and_says_what_the_run_would_fetch(stand_in, tmp_path, capsys):
    texts = "".join(json.dumps({"text": f"In the beginning God created the heaven {i}"}) + "\n" for i in range(8))
    stand_in.add("org/texts", {"data/train.jsonl": texts.encode()}, repo_type="dataset")
    argv = [*train_argv("seq", tmp_path / "dry", "--dry_run"), "--data_root_path", "org/texts"]
    assert main(argv) == 0  # nothing in the way: the run would fetch both, then train
    out = capsys.readouterr().out
    for flag, kind, repo in (("param_path", "model", REPO), ("data_root_path", "dataset", "org/texts")):
        assert (
            f"  hub          {flag} {repo}: the Hub {kind} is not cached here ({hub.cache_dir()}); the run fetches it"
            in out
        )
    assert stand_in.requests == [] and not hub.cache_dir().exists()  # not one request, nothing in the cache
    assert main(["download", REPO]) == 0
    asked = len(stand_in.requests)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"  model        {REPO}@{stand_in.commit}: weights " in out  # planned from the cache, pinned to it
    assert "param_path org/tiny: the Hub model is not cached" not in out and "data_root_path org/texts: the Hub" in out
    assert len(stand_in.requests) == asked and not (tmp_path / "dry").exists()


def test_what_is_read_as_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "here").mkdir(parents=True)
    ids = ["org/name", "Qwen/Qwen3-0.6B", "org/name@v1.0", "org/name@refs/pr/1", "a/b.c_d-e"]
    not_ids = [
        "models/here",
        "./org/name",
        "../org/name",
        "/org/name",
        "bundled:tiny",
        "name",
        "a/b/c",
        "org/",
        "org/na me",
        "org/a--b",
        "org/a..b",
        "org/name@",
        "org/-name",
        "org/name@../../x",
        "org/name@a b",
    ]
    assert [text for text in ids if not hub.is_hub_id(text)] == []
    assert [text for text in not_ids if hub.is_hub_id(text)] == []


def test_a_dataset_repository_is_served_and_fetched_whole(stand_in):
    records = b'{"text": "one"}\n{"text": "two"}\n'
    commit = stand_in.add("org/texts", {"data/train.jsonl": records, "README.md": b"# texts\n"}, repo_type="dataset")
    folder = hub.snapshot(hub.HubId.parse("org/texts"), "data_root_path", repo_type="dataset")
    assert folder.name == commit and (folder / "data" / "train.jsonl").read_bytes() == records
    assert hub.snapshot(hub.HubId("org/texts", commit), "data_root_path", repo_type="dataset") == folder


def test_a_dataset_card_pattern_matches_what_datasets_makes_of_it():
    """``*`` and ``?`` stay in one folder, ``**`` crosses folders, ``[...]`` is a class, hidden paths never match;
    hub.py then fetches each matched file by its own name (fnmatch's special characters made literal)."""
    names = [
        "a.parquet",
        "data/a.parquet",
        "data/x/b.parquet",
        "data/.hidden.parquet",
        "data/__x/c.parquet",
        "data/[1].parquet",
        "data/b?.parquet",
    ]
    assert dataset_card.matching(["data/*.parquet"], names) == ["data/[1].parquet", "data/a.parquet", "data/b?.parquet"]
    assert dataset_card.matching(["data/**"], names) == [
        "data/[1].parquet",
        "data/a.parquet",
        "data/b?.parquet",
        "data/x/b.parquet",
    ]
    assert dataset_card.matching(["**/b*.parquet"], names) == ["data/b?.parquet", "data/x/b.parquet"]
    assert dataset_card.matching(["data/?.parquet", "data/[!a]?.parquet"], names) == [
        "data/a.parquet",
        "data/b?.parquet",
    ]
    card = "---\nconfigs:\n- config_name: a\n  data_files: data/*.parquet\n---\n"
    allow = hub._dataset_allow(card, names, "data_root_path org/x", "a", None)
    assert allow == ["README.md", "data/[[]1].parquet", "data/a.parquet", "data/b[?].parquet"]
    assert [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in allow[1:])] == [
        "data/a.parquet",
        "data/[1].parquet",
        "data/b?.parquet",
    ]
