"""Models from the Hugging Face Hub: ``org/name`` and ``org/name@revision`` resolved to a local snapshot in the
standard cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``), downloaded when online, read from the cache offline
(``HF_HUB_OFFLINE=1``). Only what a run reads is fetched (``ALLOW_PATTERNS``), never pickled weights; a repository
with nothing else is refused by name. A snapshot is recorded as ``org/name@commit`` (``recorded``), which resolves
again anywhere, offline from the cache. What the cache holds (refs, snapshots, their files) is checked to stay inside
it and be what it claims before anything is read from it (``hub_cache``). A dataset repository
(``--data_root_path``) is fetched card first, then only the data files of the subset and split chosen
(``_dataset_allow``, from the card's ``configs``: a repository may hold terabytes across its subsets).

The only module importing ``huggingface_hub``, and only inside the functions that reach the Hub: a command that
names no Hub id never loads it. Its settings are read from the environment at each call (``HF_ENDPOINT``,
``HF_HUB_CACHE``/``HF_HOME``, ``HF_HUB_OFFLINE``, ``HF_TOKEN``), not from the values ``huggingface_hub`` took when
it was imported. Every error it raises for something a user can change becomes one line (``UserError``); nothing
retries: an unreachable Hub falls back to the cache or says so within ``ETAG_TIMEOUT_S``.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import sys
from pathlib import Path
from typing import Any

from astrai_fabric import assets, dataset_card, hub_cache
from astrai_fabric.errors import UserError

ALLOW_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
"""The files a run reads from a model repository (top level only: ``IGNORE_PATTERNS``)."""
IGNORE_PATTERNS = ("*/*",)
"""Nothing in subfolders (``original/consolidated.pth``, ``onnx/``): the model is the top level."""
DATASET_ALLOW_PATTERNS = ("README.md", "*.parquet", "*.arrow", "*.csv", "*.json", "*.jsonl")
"""What a dataset snapshot fetches where its card names no subsets (``configs``): the card and the files
``data.sources`` reads, in any folder (fnmatch's ``*`` crosses ``/``); not scripts, images or archives. Where the
card names subsets, only the card and the chosen subset's data files of these kinds (``_dataset_allow``)."""
DATA_SUFFIXES = tuple(pattern.removeprefix("*") for pattern in DATASET_ALLOW_PATTERNS[1:])
PICKLED = (".bin", ".pth", ".pt", ".ckpt", ".pkl")
"""Weights as pickles, which can run code when loaded: never downloaded, never read."""
NOT_WEIGHTS = ("training_args.bin",)
ETAG_TIMEOUT_S = 10.0
"""Seconds one request to the Hub waits (huggingface_hub's default, for its metadata calls and ours)."""
COMMIT = hub_cache.COMMIT
_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")
"""One part of a repository id, as the Hub allows it (``--`` and ``..`` refused apart)."""


@dataclasses.dataclass(frozen=True)
class HubId:
    """``org/name`` and the revision asked for (``main`` when none is)."""

    repo: str
    revision: str = "main"

    @classmethod
    def parse(cls, text: str) -> HubId:
        repo, _, revision = text.partition("@")
        return cls(repo, revision or "main")

    def __str__(self) -> str:
        return self.repo if self.revision == "main" else f"{self.repo}@{self.revision}"


def looks_like_hub_id(text: Any) -> bool:
    """The id rule without the filesystem: ``org/name`` or ``org/name@revision``, exactly one ``/`` in the id, no
    leading ``./``, ``../`` or ``/`` (the same answer on every rank, whatever each one's disk holds)."""
    if not isinstance(text, str) or text.startswith((assets.BUNDLED_PREFIX, "./", "../", "/", "~")):
        return False
    repo, at, revision = text.partition("@")
    if at and not hub_cache.is_revision_name(revision):  # the cache's refs/REVISION is a path: never '..'
        return False
    parts = repo.split("/")
    return (
        len(parts) == 2
        and all(_NAME.fullmatch(part) for part in parts)
        and not any("--" in part or ".." in part for part in parts)
    )


def is_hub_id(text: Any) -> bool:
    """``text`` names a Hub repository: it looks like one (``looks_like_hub_id``) and is not an existing path."""
    return looks_like_hub_id(text) and not os.path.lexists(text)


def cache_dir() -> Path:
    """Where huggingface_hub keeps snapshots, by its own rule: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
    ``XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    chosen = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expanduser(os.path.expandvars(chosen)))


def is_offline() -> bool:
    return any(
        os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _token() -> str | None:
    return os.environ.get("HF_TOKEN") or None  # None: huggingface_hub's stored token (`hf auth login`), if any


def resolve_model(path_or_id: str | Path, what: str = "param_path") -> Path:
    """A model or tokenizer directory: a local path (``bundled:NAME`` too) as it is, a Hub id as its snapshot (see
    the module docstring). ``what`` names the flag in messages."""
    text = str(path_or_id)
    if not is_hub_id(text):
        return assets.resolve(text)
    return snapshot(HubId.parse(text), what)


def local_path(
    path_or_id: str | Path, repo_type: str = "model", subset: str | None = None, split: str | None = None
) -> Path:
    """Where ``path_or_id`` is on this machine without asking the Hub: a Hub id's cached snapshot (of a ``model`` or
    ``dataset`` repository; of a dataset, holding the files of ``subset`` and ``split``), else the path (which may
    not exist)."""
    text = str(path_or_id)
    if not is_hub_id(text):
        return assets.resolve(text)
    try:
        return _cached(HubId.parse(text), repo_type, "data_root_path", subset, split)
    except UserError:
        return Path(text)


def recorded(path_or_id: str | Path) -> str:
    """How a checkpoint records a model directory: ``org/name@commit`` for a Hub snapshot (portable: it resolves
    again on any machine), else the absolute path."""
    text = str(path_or_id)
    path = local_path(text)
    if is_hub_id(text) and not path.exists():
        return text  # not fetched here: as given
    return portable(path) or str(path.resolve())


def portable(path: Path) -> str | None:
    """``org/name@commit`` where ``path`` is a snapshot in a huggingface_hub cache (``models--org--name/snapshots/
    COMMIT``, or ``datasets--...``; a repository name never holds ``--``), else None."""
    path = path.resolve()
    repository = path.parent.parent
    kind, _, name = repository.name.partition("--")
    if path.parent.name != "snapshots" or not COMMIT.fullmatch(path.name) or kind not in ("models", "datasets"):
        return None
    parts = name.split("--")
    return f"{parts[0]}/{parts[1]}@{path.name}" if len(parts) == 2 else None


def pinned(
    path_or_id: str | None, what: str, repo_type: str = "model", subset: str | None = None, split: str | None = None
) -> str | None:
    """``path_or_id`` with a Hub id replaced by ``org/name@commit`` of the snapshot it resolves to now (fetched if
    need be; a dataset's ``subset`` and ``split`` only, ``snapshot``); anything else unchanged."""
    if path_or_id is None or not is_hub_id(path_or_id):
        return path_or_id
    hub_id = HubId.parse(path_or_id)
    return _pin(hub_id, snapshot(hub_id, what, repo_type=repo_type, subset=subset, split=split), what)


def _pin(hub_id: HubId, folder: Path, what: str) -> str:
    """``org/name@COMMIT`` of ``hub_id``'s snapshot ``folder`` (``snapshots/COMMIT``, checked by ``_cached`` or
    ``snapshot``): what a run used, recorded by its commit, never by a branch that may move."""
    if not COMMIT.fullmatch(folder.name):  # a bug if reached: every snapshot returned is checked to be one
        raise UserError(f"{what} {hub_id}: {folder} is not a snapshot folder of the Hub cache (snapshots/COMMIT)")
    return f"{hub_id.repo}@{folder.name}"


HUB_FLAGS = {"param_path": "model", "tokenizer_path": "model", "reference_path": "model", "data_root_path": "dataset"}
"""The training flags that may name a Hub repository (a model or tokenizer directory, a dataset), and its type."""


def dataset_choice(flag: str, subset: str | None = None, split: str | None = None) -> dict[str, str | None]:
    """``{subset, split}`` (``--data_subset``, ``--data_split``) where ``flag`` names a dataset, else nothing: what of
    a dataset repository is fetched, known wherever a flag is pinned or fetched, so that every rank's node fetches
    the same files."""
    if HUB_FLAGS[flag] != "dataset":
        return {}
    return {"subset": subset, "split": split}


def pin_hub_flags(
    values: dict[str, str | None], subset: str | None = None, split: str | None = None
) -> dict[str, str | None]:
    """``values`` (``{flag: value}`` of ``HUB_FLAGS``) with each Hub id pinned (``pinned``; of the dataset,
    ``subset`` and ``split``: ``dataset_choice``): set in place of the flags, every later read of them finds the same
    snapshots, and the checkpoints' meta.json and recipe record ``org/name@commit``."""
    return {
        flag: pinned(value, flag, HUB_FLAGS[flag], **dataset_choice(flag, subset, split))
        for flag, value in values.items()
    }


def pin_cached_flags(
    values: dict[str, str | None], subset: str | None = None, split: str | None = None
) -> tuple[dict[str, str | None], dict[str, str]]:
    """``--dry_run``'s ``pin_hub_flags``, which downloads nothing: each of ``values`` (``{flag: value}`` of
    ``HUB_FLAGS``) that is a Hub id whose snapshot this machine's cache holds is pinned to it (no request: the run
    itself asks the Hub for the branch's newest commit); one it lacks is left as it is. Returns the values so pinned
    and the flags not cached, ``{flag: what the plan says}``. Offline, a missing one is the run's own error
    (``snapshot``)."""
    pinned_values, uncached = dict(values), {}
    for flag, value in values.items():
        repo_type, choice = HUB_FLAGS[flag], dataset_choice(flag, subset, split)
        if value is None or not is_hub_id(value):
            continue
        hub_id = HubId.parse(value)
        try:  # a card naming no such subset is the run's error, said here too (it is cached: no request)
            folder = _cached(hub_id, repo_type, flag, **choice)
        except _NotCached:
            if is_offline():
                snapshot(hub_id, flag, repo_type=repo_type, **choice)  # raises its one line
            uncached[flag] = (
                f"{flag} {value}: the Hub {repo_type} is not cached here ({cache_dir()}); the run "
                "fetches it first, so what it holds is not planned here"
            )
            continue
        pinned_values[flag] = _pin(hub_id, folder, flag)
    return pinned_values, uncached


def fetch(pin: str, flag: str, subset: str | None = None, split: str | None = None) -> Path:
    """The snapshot ``pin`` (``org/name@commit``) of ``flag`` names, fetched if this machine's cache lacks it (of a
    dataset, ``subset`` and ``split``: ``dataset_choice``)."""
    return snapshot(HubId.parse(pin), flag, repo_type=HUB_FLAGS[flag], subset=subset, split=split)


def download(text: str, revision: str | None = None, local_dir: str | None = None) -> tuple[Path, str | None]:
    """``astrai-fabric download``: the snapshot of ``text`` (``org/name``, ``@revision`` or ``revision``) in the
    cache, or copied into ``local_dir``, with huggingface_hub's progress bars; and, where it was read from the cache
    with nothing fetched, why (``_snapshot``), else None."""
    if not looks_like_hub_id(text):
        raise UserError(f"download {text!r}: expected a Hub model id, org/name or org/name@revision")
    hub_id = HubId.parse(text)
    if revision is not None:
        if "@" in text and hub_id.revision != revision:
            raise UserError(f"download {text}: --revision {revision} contradicts the @{hub_id.revision} it names")
        hub_id = HubId(hub_id.repo, revision)
    if local_dir is not None and os.path.lexists(local_dir) and not Path(local_dir).is_dir():
        raise UserError(f"--local_dir {local_dir}: a file, not a directory")
    return _snapshot(hub_id, "download", "model", local_dir, None, None)


def snapshot(
    hub_id: HubId,
    what: str,
    *,
    repo_type: str = "model",
    local_dir: str | None = None,
    subset: str | None = None,
    split: str | None = None,
) -> Path:
    """The local snapshot of ``hub_id``: from the cache when the revision is a commit it holds or when offline,
    else fetched (a model: only ``ALLOW_PATTERNS``, after the repository's file list says its weights are not only
    pickled; a dataset: its card first, then the data files of ``subset`` (``--data_subset``; and of ``split``
    where the card names splits), ``_dataset_allow``). ``repo_type`` is ``model`` or ``dataset``."""
    return _snapshot(hub_id, what, repo_type, local_dir, subset, split)[0]


def _snapshot(
    hub_id: HubId, what: str, repo_type: str, local_dir: str | None, subset: str | None, split: str | None
) -> tuple[Path, str | None]:
    """``snapshot``'s folder, and why it was read from the cache with nothing fetched (offline, a commit the cache
    holds, the Hub out of reach), or None where the Hub was asked for what the cache lacked."""
    where = f"{what} {hub_id}"
    hub_cache.check_revision(hub_id.revision, where)  # before any request: the cache's refs/REVISION is a path
    if local_dir is None and (is_offline() or COMMIT.fullmatch(hub_id.revision)):
        try:
            why = "HF_HUB_OFFLINE=1" if is_offline() else f"the cache holds commit {hub_id.revision}"
            return _cached(hub_id, repo_type, what, subset, split), why
        except _NotCached as missing:
            if is_offline():
                get = f"`astrai-fabric download {hub_id}`" if repo_type == "model" else "the same command"
                chosen = "".join(
                    f" ({flag} {value!r})"
                    for flag, value in (("--data_subset", subset), ("--data_split", split))
                    if value is not None
                )
                raise UserError(
                    f"{where}: not a directory here, and HF_HUB_OFFLINE=1 with no cached copy of the Hub {repo_type} "
                    f"{hub_id}{chosen} in {cache_dir()}{missing.detail}; get one with {get} while online, or unset "
                    "HF_HUB_OFFLINE"
                ) from None
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    try:
        info = HfApi(endpoint=_endpoint(), token=_token()).repo_info(
            hub_id.repo, revision=hub_id.revision, repo_type=repo_type, timeout=ETAG_TIMEOUT_S
        )
    except Exception as err:
        if local_dir is None and _is_unreachable(err):
            try:
                folder = _cached(hub_id, repo_type, what, subset, split)
            except _NotCached:
                raise UserError(
                    f"{where}: not a directory here, and the Hub ({_endpoint()}) cannot be reached "
                    f"({_reason(err)}) with no cached copy; check the network (or HF_ENDPOINT), or run "
                    f"`astrai-fabric download {hub_id}` where the Hub is reachable"
                ) from None
            print(
                f"astrai-fabric: the Hub cannot be reached ({_reason(err)}); using the cached {folder}", file=sys.stderr
            )
            return folder, "the Hub cannot be reached"
        raise _user_error(err, hub_id, where, repo_type) from None
    if repo_type == "model":
        _refuse_pickled_only(info, hub_id, where)
    allow, ignore = _patterns(repo_type)
    if repo_type == "dataset":  # the card first, alone: it says which of the repository's files the subset needs
        names = [sibling.rfilename for sibling in info.siblings or ()]
        card = None
        if dataset_card.CARD in names:
            try:
                card_file = hf_hub_download(
                    hub_id.repo,
                    dataset_card.CARD,
                    repo_type=repo_type,
                    revision=info.sha,
                    cache_dir=cache_dir(),
                    local_dir=local_dir,
                    endpoint=_endpoint(),
                    token=_token(),
                    etag_timeout=ETAG_TIMEOUT_S,
                )
            except Exception as err:
                raise _user_error(err, hub_id, where, repo_type) from None
            if local_dir is None:  # one already cached is returned as it is, wherever it leads
                hub_cache.check_in_snapshot(Path(card_file), _repository(hub_id, repo_type, where), where)
            try:
                card = dataset_card.read_card(Path(card_file).parent)
            except Exception as err:
                raise _user_error(err, hub_id, where, repo_type) from None
        allow = _dataset_allow(card, names, where, subset, split)
    try:
        folder = snapshot_download(
            hub_id.repo,
            repo_type=repo_type,
            revision=hub_id.revision,
            cache_dir=cache_dir(),
            local_dir=local_dir,
            allow_patterns=allow,
            ignore_patterns=ignore,
            endpoint=_endpoint(),
            token=_token(),
            etag_timeout=ETAG_TIMEOUT_S,
        )
    except Exception as err:
        raise _user_error(err, hub_id, where, repo_type) from None
    if repo_type == "dataset" and Path(folder).name != info.sha:  # the files chosen by another commit's card
        raise UserError(f"{where}: the Hub repository moved to another commit while it was fetched; run again")
    if local_dir is not None:
        return Path(folder), None
    # Files already in the snapshot are kept as they are, wherever they lead: checked as offline.
    checked = hub_cache.checked_snapshot(_repository(hub_id, repo_type, where), Path(folder).name, where)
    if checked is None:
        raise UserError(f"{where}: the download left no snapshot folder at {folder}; run again")
    return checked, None


def _dataset_allow(card: str | None, names: list[str], where: str, subset: str | None, split: str | None) -> list[str]:
    """What of a dataset repository holding ``names`` (its files) a snapshot fetches: where its ``card`` names no
    subsets (``configs``), every data file (``DATASET_ALLOW_PATTERNS``, as ``datasets`` reads such a repository);
    else the card and the data files of the subset chosen (``dataset_card.choose``), and only ``split``'s where the
    card names the subset's files per split. A subset or split the card does not name is refused here, before any
    data file is fetched."""
    found = dataset_card.subsets(card, f"{where}: {dataset_card.CARD}")
    if found is None:
        if subset not in (None, "default"):
            raise UserError(
                f"--data_subset {subset!r}: {where} has no such subset; it has 'default' (its "
                f"{dataset_card.CARD} names no configs)"
            )
        return list(DATASET_ALLOW_PATTERNS)
    chosen = dataset_card.choose(found, subset, where)
    if chosen.splits is None and not chosen.data_dir:  # an entry naming no files reads the whole layout
        return list(DATASET_ALLOW_PATTERNS)
    if chosen.splits is None:
        patterns = [f"{chosen.data_dir}/**"]
    else:
        patterns = [p for each in dataset_card.split_patterns(chosen, split, where).values() for p in each]
    files = [name for name in dataset_card.matching(patterns, names) if name.lower().endswith(DATA_SUFFIXES)]
    if not files:
        shown = ", ".join(patterns[:3]) + (f" and {len(patterns) - 3} more" if len(patterns) > 3 else "")
        raise UserError(
            f"{where}: subset {chosen.name!r} of its {dataset_card.CARD} names data files ({shown}) that "
            "match no parquet, arrow, CSV or JSON file of the repository"
        )
    # Each file by its own name (snapshot_download's patterns are fnmatch's: its special characters made literal).
    return [dataset_card.CARD, *(re.sub(r"[*?[]", lambda m: f"[{m.group()}]", name) for name in files)]


def _patterns(repo_type: str) -> tuple[list[str], list[str] | None]:
    if repo_type == "model":
        return list(ALLOW_PATTERNS), list(IGNORE_PATTERNS)
    return list(DATASET_ALLOW_PATTERNS), None


class _NotCached(UserError):
    """This machine's cache has no complete snapshot of what was asked (any other UserError of ``_cached`` is a
    mistake in what was asked, a subset its cached card does not name, or a cache refused by ``hub_cache``).
    ``detail``: what is there instead, for the offline message (`` (its ref ... names ...)``), or nothing."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


def _repository(hub_id: HubId, repo_type: str, where: str) -> Path:
    """The cache's folder of ``hub_id``'s repository (``hub_cache.repository_folder``)."""
    return hub_cache.repository_folder(cache_dir(), hub_id.repo, repo_type, where)


def _cached(
    hub_id: HubId,
    repo_type: str = "model",
    what: str = "param_path",
    subset: str | None = None,
    split: str | None = None,
) -> Path:
    """The cached snapshot of ``hub_id``, complete for what ``snapshot`` fetches (of a dataset: what its cached card
    says ``subset`` and ``split`` need), without a request; ``_NotCached`` if there is none. The ref and the
    snapshot are read and checked here (``hub_cache``), and huggingface_hub is then asked for the commit they name:
    it never joins a ref's contents onto a path itself."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    where = f"{what} {hub_id}"
    folder = _repository(hub_id, repo_type, where)
    commit = hub_id.revision
    if not COMMIT.fullmatch(commit):
        commit = hub_cache.read_ref(folder, hub_id.revision, where)
        if commit is None:
            raise _NotCached(f"{hub_id}: no cached snapshot (no ref {folder / 'refs' / hub_id.revision})")
    if hub_cache.checked_snapshot(folder, commit, where) is None:
        named = "" if commit == hub_id.revision else f"its ref {folder / 'refs' / hub_id.revision} names {commit}, but "
        detail = f" ({named}the snapshot {folder / 'snapshots' / commit} is not there)"
        raise _NotCached(f"{hub_id}: no cached snapshot{detail}", detail if named else "")
    allow, ignore = _patterns(repo_type)

    def cached(patterns: list[str]) -> Path:
        try:
            return Path(
                snapshot_download(
                    hub_id.repo,
                    repo_type=repo_type,
                    revision=commit,
                    cache_dir=cache_dir(),
                    local_files_only=True,
                    allow_patterns=patterns,
                    ignore_patterns=ignore,
                )
            )
        except (LocalEntryNotFoundError, OSError, ValueError) as err:  # ValueError: huggingface_hub's validation
            raise _NotCached(f"{hub_id}: no cached snapshot ({_reason(err)})") from None

    if repo_type != "dataset":
        return cached(allow)
    card_folder = cached([dataset_card.CARD])  # the card first: it says which files the subset needs
    names = _cached_names(HubId(hub_id.repo, commit), card_folder)
    return cached(_dataset_allow(dataset_card.read_card(card_folder), names, where, subset, split))


def _cached_names(hub_id: HubId, folder: Path) -> list[str]:
    """The dataset repository's files as the tree listing ``snapshot_download`` cached says (huggingface_hub 2.x),
    else as the snapshot folder holds them."""
    try:
        from huggingface_hub import get_cached_repo_tree

        tree = get_cached_repo_tree(hub_id.repo, repo_type="dataset", revision=hub_id.revision, cache_dir=cache_dir())
        return [entry.path for entry in tree]
    except Exception:  # noqa: BLE001 — no listing cached (or an older huggingface_hub): the folder's files
        return [path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file()]


def _refuse_pickled_only(info: Any, hub_id: HubId, where: str) -> None:
    names = [s.rfilename for s in info.siblings or () if "/" not in s.rfilename]
    pickled = [n for n in names if n.endswith(PICKLED) and n not in NOT_WEIGHTS]
    if pickled and not any(n.endswith(".safetensors") for n in names):
        shown = ", ".join(pickled[:3]) + (f" and {len(pickled) - 3} more" if len(pickled) > 3 else "")
        raise UserError(
            f"{where}: the Hub repository {hub_id.repo} holds its weights only as pickled files ({shown}), which can "
            "run code when loaded and are never read here; use a repository with *.safetensors weights (or convert "
            "them to safetensors where the pickle is trusted)"
        )


def _transport_errors() -> tuple[type, ...]:
    """The HTTP client's network errors (huggingface_hub 1.x uses httpx, 2.x httpx2), wherever it is loaded."""
    found = [getattr(sys.modules.get(name), "TransportError", None) for name in ("httpx2", "httpx", "requests")]
    return tuple(t for t in found if isinstance(t, type))


def _is_unreachable(err: Exception) -> bool:
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(err, HfHubHTTPError):
        return err.response is not None and err.response.status_code in (502, 503, 504)
    return isinstance(err, (ConnectionError, TimeoutError, *_transport_errors()))


def _reason(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:200]}" if text else type(err).__name__


def _user_error(err: Exception, hub_id: HubId, where: str, repo_type: str) -> Exception:
    """huggingface_hub's error for ``hub_id`` as one line; an error that is not one of the user's is returned as
    it is (a bug)."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    status = getattr(getattr(err, "response", None), "status_code", None)
    if isinstance(err, GatedRepoError) or (isinstance(err, HfHubHTTPError) and status == 403):
        return UserError(
            f"{where}: the Hub repository {hub_id.repo} is gated or private and this request is not allowed (HTTP "
            f"{status}); set HF_TOKEN to a token with access, and accept its terms on its Hub page if it asks"
        )
    if isinstance(err, RevisionNotFoundError):
        return UserError(
            f"{where}: the Hub repository {hub_id.repo} has no revision {hub_id.revision!r} (a branch, tag or commit)"
        )
    if isinstance(err, RepositoryNotFoundError) or (isinstance(err, HfHubHTTPError) and status == 401):
        return UserError(
            f"{where}: no such directory here, and no {repo_type} repository {hub_id.repo} on the Hub ({_endpoint()}); "
            "fix the path, or the id (a private repository needs HF_TOKEN)"
        )
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return UserError(
            f"{where}: the disk is full while downloading into {cache_dir()} ({err.strerror}); free "
            "space, or point HF_HUB_CACHE (or --local_dir) at a disk with room"
        )
    if isinstance(err, PermissionError):
        return UserError(
            f"{where}: cannot write the download into {cache_dir()} ({err.strerror}: "
            f"{err.filename}); point HF_HUB_CACHE at a directory you can write"
        )
    if isinstance(err, LocalEntryNotFoundError) or _is_unreachable(err):
        return UserError(
            f"{where}: the Hub ({_endpoint()}) cannot be reached ({_reason(err)}) to download it; "
            f"check the network (or HF_ENDPOINT), or run `astrai-fabric download {hub_id}` where it "
            "is"
        )
    if isinstance(err, HfHubHTTPError):
        return UserError(f"{where}: the Hub answered HTTP {status} ({_reason(err)}); try again later")
    return err
