"""The linter CI runs before the tests (.ci/run: `ruff check .`, configured in pyproject.toml [tool.ruff]): it reports
a planted violation under the repository's own configuration, and the repository itself passes it."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = [
  pytest.mark.process,
  pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                     reason="ruff is not installed (the dev extra has it: pip install -c constraints.txt -e '.[dev]')"),
]


def _ruff(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *args],
                        cwd=cwd, capture_output=True, text=True, timeout=120)


def test_a_planted_violation_is_reported_under_the_repository_config(tmp_path):
  bad = tmp_path / "planted.py"
  # an unused import and a line over 120 columns; 2-space indentation (the project's style) is not a finding
  bad.write_text("import os\n\n\ndef f(x):\n  if x:\n    return 1\n  return 2  # " + "a long comment " * 8 + "\n")
  done = _ruff("--config", str(ROOT / "pyproject.toml"), str(bad), cwd=tmp_path)
  out = done.stdout + done.stderr
  assert done.returncode == 1, out
  assert "planted.py:1:8: F401" in out and "planted.py:7:121: E501" in out, out
  assert "E111" not in out and "E114" not in out and "E117" not in out, out

def test_the_repository_passes_the_linter():
  done = _ruff(".")
  assert done.returncode == 0, done.stdout + done.stderr
