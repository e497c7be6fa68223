"""``regular_files``: a file read from outside is opened as what it is, once. Each kind of non-regular file refused
by name, the ``within`` rule for links found by a scan, and the size known (and bounded) before a byte is read.
Real FIFOs, sockets, devices and links; nothing mocked. The CLI's cases are in tests/test_hostile_input.py."""

from __future__ import annotations

import os
import re
import socket
import stat
import threading
from pathlib import Path

import pytest

from astrai_fabric.errors import CheckpointError, UserError
from astrai_fabric.regular_files import (
    READ_FLAGS,
    check_regular_file,
    open_regular_file,
    read_regular_file,
    regular_file_size,
)
from astrai_fabric.tokenizer import MAX_TOKENIZER_BYTES, Tokenizer


def unix_socket(path: Path) -> None:
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.close()  # the socket file stays behind


def a_block_device() -> str | None:
    """Some block device of this machine, where the container shows one."""
    for entry in sorted(os.scandir("/dev"), key=lambda e: e.name):
        if stat.S_ISBLK(entry.stat(follow_symlinks=False).st_mode):
            return entry.path
    return None


NOT_FILES = [
    ("fifo", lambda p: os.mkfifo(p), "", r"{p}: is a FIFO, not a file \(expected a thing\)$"),
    ("directory", lambda p: p.mkdir(), "", r"{p}: is a directory, not a file"),
    ("socket", unix_socket, "", r"{p}: is a socket, not a file"),
    ("dev-zero", lambda p: p.symlink_to("/dev/zero"), "", r"{p}: links to /dev/zero, a character device, not a file"),
    ("link-to-fifo", lambda p: (os.mkfifo(p.parent / "f"), p.symlink_to("f")), "", r"{p}: links to .*/f, a FIFO"),
    ("dangling", lambda p: p.symlink_to("gone"), "", r"{p}: a link to gone, which does not exist"),
    ("loop", lambda p: p.symlink_to(p.name), "", r"{p}: a link that cannot be followed \("),
    ("missing", lambda p: None, "", r"{p}: file not found \(expected a thing\)$"),
    ("under-a-file", lambda p: p.write_text(""), "x", r"{p}/x: file not found \({p} is a file, not a directory\)"),
]  # fmt: skip


@pytest.mark.parametrize("make, below, message", [c[1:] for c in NOT_FILES], ids=[c[0] for c in NOT_FILES])
def test_what_is_not_a_regular_file_is_refused_by_name(tmp_path, make, below, message):
    path = tmp_path / "s"  # short: a unix socket's name has a length limit
    make(path)
    with pytest.raises(UserError, match=message.replace("{p}", re.escape(str(path)))):
        read_regular_file(path / below if below else path, max_bytes=1 << 20, what="a thing")


def test_devices_are_refused_without_being_opened():
    with pytest.raises(CheckpointError, match="^/dev/null: is a character device, not a file$"):
        check_regular_file("/dev/null", error=CheckpointError)
    if (device := a_block_device()) is None:
        pytest.skip("no block device visible here")
    with pytest.raises(UserError, match=f"^{re.escape(device)}: is a block device, not a file$"):
        check_regular_file(device)  # refused by its status: opening it (no permission here, perhaps) never tried


def test_the_open_itself_cannot_block_and_the_descriptor_is_what_is_checked(tmp_path):
    """A FIFO put in place between the look and the open: the open returns at once (non-blocking), and the
    descriptor's own status refuses it."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    opened: list[int] = []
    opener = threading.Thread(target=lambda: opened.append(os.open(fifo, READ_FLAGS)), daemon=True)
    opener.start()
    opener.join(timeout=10)
    if opener.is_alive():  # it blocked: let it go (a writer arrives), then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        opener.join()
        os.close(opened[0])
        pytest.fail("opening a FIFO with READ_FLAGS blocked waiting for a writer")
    try:
        with pytest.raises(UserError, match=f"{re.escape(str(fifo))}: is a FIFO, not a file"):
            regular_file_size(opened[0], fifo)
    finally:
        os.close(opened[0])


def test_links_found_by_a_scan_are_read_only_within_their_root(tmp_path):
    root, outside = tmp_path / "ck", tmp_path / "secret.pt"
    root.mkdir()
    outside.write_bytes(b"secret")
    (root / "own.pt").write_bytes(b"own")
    (root / "inner.pt").symlink_to("own.pt")  # within the root: followed
    (root / "out.pt").symlink_to(outside)
    (root / "up.pt").symlink_to("../secret.pt")
    assert read_regular_file(root / "inner.pt", max_bytes=10, what="x", within=root) == b"own"
    for name in ("out.pt", "up.pt"):
        with pytest.raises(
            UserError, match=rf"{name}: links to {re.escape(str(outside))}, outside {re.escape(str(root))}"
        ):
            read_regular_file(root / name, max_bytes=10, what="x", within=root)
    assert read_regular_file(root / "out.pt", max_bytes=10, what="x") == b"secret"  # a link the user named: followed
    # Several roots (a snapshot and its repository's blobs/); a root reached through a link of its own counts as
    # where it resolves to.
    assert read_regular_file(root / "out.pt", max_bytes=10, what="x", within=[root, tmp_path]) == b"secret"
    (tmp_path / "alias").symlink_to("ck")
    assert read_regular_file(tmp_path / "alias" / "inner.pt", max_bytes=10, what="x", within=tmp_path / "alias")
    with pytest.raises(UserError, match=r"out.pt: links to .*, outside the model directory; its files are read only"):
        check_regular_file(root / "out.pt", within=root, within_name="the model directory", error=CheckpointError)


def test_the_size_is_known_and_bounded_before_a_byte_is_read(tmp_path):
    big = tmp_path / "big.json"
    with big.open("wb") as file:
        file.truncate((64 << 20) + 1)  # sparse: no disk, and reading it would take 64 MiB
    with pytest.raises(UserError, match=r"big.json: 67108865 bytes, too large for a thing \(at most 64 MiB\)$"):
        read_regular_file(big, max_bytes=64 << 20, what="a thing")
    with pytest.raises(UserError, match=r"too large for a thing \(at most 1,000 bytes\)$"):
        read_regular_file(big, max_bytes=1000, what="a thing")
    exact = tmp_path / "exact"
    exact.write_bytes(b"x" * 1000)
    assert read_regular_file(exact, max_bytes=1000, what="a thing") == b"x" * 1000
    # The size is the descriptor's when it was opened: a file growing meanwhile is read as it was then.
    with open_regular_file(exact) as opened:
        with exact.open("ab") as writer:
            writer.write(b"y" * 5000)
        assert opened.size_bytes == 1000 and opened.read() == b"x" * 1000


def test_a_tokenizer_json_past_its_cap_is_refused_before_it_is_read(tmp_path):
    directory = tmp_path / "t"
    directory.mkdir()
    with (directory / "tokenizer.json").open("wb") as file:
        file.truncate(MAX_TOKENIZER_BYTES + 1)  # sparse: reading it would take a GiB
    with pytest.raises(
        UserError, match=r"tokenizer.json: 1073741825 bytes, too large for a tokenizers file \(at most 1 GiB\)"
    ):
        Tokenizer.from_dir(directory)
