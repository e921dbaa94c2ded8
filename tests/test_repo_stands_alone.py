"""The repository stands alone: its docs and code point at nothing outside it.

README.md, docs/, the packages (parity/, jax_impl/, torch_impl/) and the Markdown under benchmarks/ must not send a
reader to the folder around a checkout (`../shared`, `shared/NUMERICS.md`, ...) or to issue numbers of a tracker
(`issue #31`, `issue 31`, `#31`, `pre-#18`): facts they need live in the repository (docs/numerics.md,
docs/install.md), and the real DeepSpeed configs the port tests read are in tests/data/realworld/ds_configs with
their sources (SOURCES.md there). Upstream pull requests (`openxla/xla PR #37979`) and CSS colours (`color:#555`)
are not issue references. Every tracked text file outside tests/data (the tests and benchmarks included) is held to
the same rule, to no tracker's completion notes (`done-when`), and to no word on how the repository was built
(`(breaker, 2026-12-02)`, `a breaker's runs`): a comment says what a line guards against, not who found it or when.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REALWORLD = ROOT / "tests" / "data" / "realworld" / "ds_configs"
TEXT_SUFFIXES = {".md", ".py", ".txt", ".toml", ".json", ".html", ".css", ".js", ".sh", ".yaml", ".yml", ".cfg"}

OUTSIDE = [
    ("a path outside the repository", re.compile(r"\.\./shared\b")),
    ("a workspace note", re.compile(r"(?<![\w.-])shared/(?:NUMERICS|GPU|TPU|DESIGN|STYLE|SCHEMA)\.md|"
                                    r"(?<![\w.-])shared/realworld\b")),
    ("an issue reference", re.compile(r"\bissues?[ -]?#?\d+\b", re.IGNORECASE)),
    # '#31', 'pre-#18', '(#20)': not a CSS colour (':#555', '"#555"'), an anchor ('##'), an entity ('&#38;') or an
    # upstream pull request ('PR #37979', 'PRs #38937, #38939': five digits, and the prefix)
    ("an issue reference", re.compile(r"(?<![\w&#/:\"'=])(?<!PR )(?<!PRs )#\d{1,3}\b")),
    ("a tracker's completion note", re.compile(r"\bdone-when\b", re.IGNORECASE)),
    ("a note on how the repository was built", re.compile(r"breaker", re.IGNORECASE)),
]


def scanned_files() -> list[Path]:
  """README.md, every text file under docs/ and the packages, and every Markdown file under benchmarks/."""
  files = [ROOT / "README.md"]
  for top in ("docs", "parity", "jax_impl", "torch_impl"):
    files += [p for p in (ROOT / top).rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
              and "__pycache__" not in p.parts]
  files += list((ROOT / "benchmarks").rglob("*.md"))
  return sorted(files)


def tracked_text_files() -> list[Path]:
  """Every file git tracks outside tests/data that reads as text (no NUL byte), this file excepted: its docstring and
  planted lines name what it forbids. Without git (an unpacked archive), every file under the root but hidden folders,
  virtual environments and caches."""
  try:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    paths = [ROOT / p for p in out.decode().split("\0") if p]
  except (OSError, subprocess.SubprocessError):
    paths = [p for p in ROOT.rglob("*") if not any(part.startswith(".") or part in ("__pycache__", "build", "dist")
                                                   for part in p.relative_to(ROOT).parts)]
  data = ROOT / "tests" / "data"
  keep = []
  for p in paths:
    if not p.is_file() or p == Path(__file__).resolve() or p.is_relative_to(data):
      continue
    if b"\0" not in p.read_bytes()[:8192]:
      keep.append(p)
  return sorted(keep)


def offences(text: str) -> list[tuple[int, str, str]]:
  """(line number, what, the match) of every reference to something outside the repository in `text`."""
  out = []
  for n, line in enumerate(text.splitlines(), 1):
    for what, rx in OUTSIDE:
      out += [(n, what, m.group(0)) for m in rx.finditer(line)]
  return out


def test_docs_and_code_point_at_nothing_outside_the_repository():
  files = scanned_files()
  assert len(files) > 100 and ROOT / "docs" / "numerics.md" in files
  bad = [f"{f.relative_to(ROOT).as_posix()}:{n}: {what}: {hit!r}"
         for f in files for n, what, hit in offences(f.read_text(errors="replace"))]
  assert not bad, "references outside the repository:\n" + "\n".join(bad)


def test_no_tracked_file_outside_tests_data_names_an_issue_or_a_completion_note():
  """The tests, benchmarks and their results too: a test's docstring says what it checks, not which ticket asked
  or who found the bug."""
  files = tracked_text_files()
  names = {f.relative_to(ROOT).as_posix() for f in files}
  assert len(files) > 400 and {"tests/test_docs.py", "benchmarks/masked_step.py", "README.md"} <= names
  assert not any(n.startswith("tests/data/") for n in names) and f"tests/{Path(__file__).name}" not in names
  bad = [f"{f.relative_to(ROOT).as_posix()}:{n}: {what}: {hit!r}"
         for f in files for n, what, hit in offences(f.read_text(errors="replace"))]
  assert not bad, "issue references, completion notes or notes on how it was built:\n" + "\n".join(bad)


@pytest.mark.parametrize("line", [
    "see ../shared/NUMERICS.md", "(shared/NUMERICS.md)", "configs in `../shared/realworld`", "shared/GPU.md",
    "the GPU check issue #4 still owes", "issue 31 asks", "Issue #20 item 6:", "issues #22 and #23", "(#31)",
    "a pre-#18 report", "one per issue-#21 family", "see #7.",
    "(issue #20, done-when: >= 0.95x the tokens/s of stream)", "the rule before issue #11", "Issue #22's Done-when:",
    "# issue 18 item 9: paths the user gives", "(#23 item 2)", "the done-when of the benchmark",
    "padding value in input_ids (breaker, 2026-12-02)", '"""Breaker finding: a 2-step run', "in a breaker's runs",
    "BREAKER case:", "and the breakers' fixes", "at its next eval-breaker check",
])
def test_a_planted_reference_is_caught(line):
  assert offences(line), line


@pytest.mark.parametrize("line", [
    "tr.fail td{background:#fff1f1} tr.info td{color:#555}", '<line stroke="#555"/>', "&#38;", "## 2. Steps",
    "openxla/xla PR #37979", "jax-ml/jax PRs #38937 and #38939", "sglang PR #35641", "docs/numerics.md",
    "tests/data/realworld/ds_configs", "a tissue 3 cm", "[link](#section-2)", "break out of the loop",
])
def test_benign_text_is_not_flagged(line):
  assert not offences(line), offences(line)


def _sources() -> list[dict[str, str]]:
  rows = []
  for line in (REALWORLD / "SOURCES.md").read_text().splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 4 and cells[0].endswith(".json"):
      rows.append(dict(zip(("file", "repo", "path", "commit"), cells)))
  return rows


def test_every_real_config_is_in_the_repository_with_its_source():
  """26 configs, each a JSON document, each with its repository, path and a full commit hash in SOURCES.md."""
  files = sorted(p.name for p in REALWORLD.glob("*.json"))
  rows = _sources()
  assert len(files) == 26 and sorted(r["file"] for r in rows) == files
  for r in rows:
    assert re.fullmatch(r"[0-9a-f]{40}", r["commit"]), r
    assert r["file"] == r["repo"].replace("/", "__") + "__" + r["path"].replace("/", "__"), r
    assert isinstance(json.loads((REALWORLD / r["file"]).read_text()), dict), r["file"]


def test_the_tests_read_the_in_repository_configs_without_an_environment_variable():
  """PARITY_REALWORLD is an override only: every test module that reads it defaults to tests/data/realworld."""
  default = 'os.environ.get("PARITY_REALWORLD") or Path(__file__).parent / "data" / "realworld" / "ds_configs"'
  readers = [p for p in sorted((ROOT / "tests").glob("test_*.py"))
             if p.name != Path(__file__).name and 'environ.get("PARITY_REALWORLD"' in p.read_text()]
  assert len(readers) >= 4, readers
  for p in readers:
    assert default in p.read_text(), f"{p.name} reads PARITY_REALWORLD without the in-repository default"
  from tests.test_migrate import REAL, REAL_FILES
  if not os.environ.get("PARITY_REALWORLD"):
    assert REAL.resolve() == REALWORLD and len(REAL_FILES) == 26
