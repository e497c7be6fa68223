"""AstrAI's own code as a test oracle, run in a subprocess with its own interpreter.

Found without configuration where the project sits beside the AstrAI snapshot (`../shared/astrai`, with the venv
`.ci/run` builds at `.astrai-venv`); elsewhere set ASTRAI_SRC and ASTRAI_PYTHON. Without both, the tests that
need it skip and say why.
"""

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent.parent


def _first_existing(*candidates: Path) -> str | None:
    return next((str(path) for path in candidates if path.exists()), None)


def _absolute(path: str | None) -> str | None:
    return os.path.abspath(path) if path else None  # its subprocesses run in other working directories


ASTRAI_SRC = _absolute(
    os.environ.get("ASTRAI_SRC") or _first_existing(_ROOT.parent / "shared" / "astrai", _ROOT / "shared" / "astrai")
)
ASTRAI_PYTHON = _absolute(os.environ.get("ASTRAI_PYTHON") or _first_existing(_ROOT / ".astrai-venv" / "bin" / "python"))

needs_astrai = pytest.mark.skipif(
    not (ASTRAI_SRC and ASTRAI_PYTHON),
    reason="AstrAI not found: set ASTRAI_SRC and ASTRAI_PYTHON, or run ../shared/astrai/setup-venv.sh .astrai-venv",
)


def astrai_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=ASTRAI_SRC, OMP_NUM_THREADS="1")


def run_astrai(script: str) -> str:
    """Run a Python snippet under AstrAI's interpreter; return its stdout, fail the test on a non-zero exit."""
    result = subprocess.run(
        [ASTRAI_PYTHON, "-c", textwrap.dedent(script)], capture_output=True, text=True, env=astrai_env()
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def run_astrai_cli(jobs: list[dict], jobs_file: Path) -> str:
    """Run AstrAI's training CLI on each job in one AstrAI process (``astrai_cli_driver.py`` says what a job is and
    what the driver changes in AstrAI: float32 only); return its output, fail the test on a non-zero exit."""
    jobs_file.write_text(json.dumps(jobs))
    driver = Path(__file__).with_name("astrai_cli_driver.py")
    env = dict(astrai_env(), ASTRAI_SRC=ASTRAI_SRC)
    result = subprocess.run([ASTRAI_PYTHON, str(driver), str(jobs_file)], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stderr
