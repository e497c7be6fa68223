"""``python -m astrai_fabric`` runs the CLI."""

from astrai_fabric.cli import run

run()
