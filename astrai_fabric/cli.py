"""``astrai-fabric``: the command line. The only module that imports jsonargparse.

Mistakes a user can fix (``UserError``) print one line and exit with status 2, never a traceback.
"""

from __future__ import annotations

import sys

from jsonargparse import ArgumentParser

from astrai_fabric import __version__
from astrai_fabric.errors import UserError


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="astrai-fabric",
        description="Train AstrAI decoder-only language models on Lightning Fabric.",
        exit_on_error=True,
    )
    parser.add_argument("--version", action="version", version=f"astrai-fabric {__version__}")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        parser.parse_args(argv)
        parser.print_help()
    except UserError as err:
        print(f"astrai-fabric: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
