"""``python -m astrai_fabric`` runs the CLI."""

import sys

from astrai_fabric.cli import main

sys.exit(main())
