"""The README's picture shows today's report page: docs/img/report.png is a screenshot of report.html, so it must not be
older than the template the page is built from. The template is `parity/report/html.py` (the stylesheet and the HTML
building blocks: how the page looks) and `parity/report/page.py` (which sections the page holds, in which order).
What a run's numbers are, and the figures' own drawing (`parity/report/plots.py`), are content, not the template.

Compared by git commit time (`git log -1 --format=%ct -- PATH`), so a checkout's file times do not matter; skipped,
saying why, outside a git checkout or where the history lacks one of the files (a shallow clone). When it fails, take
a new screenshot of the default run's report.html with headless Chromium (docs/testing.md, "The picture in the
README") and commit it."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from conftest import ROOT

PICTURE = "docs/img/report.png"
TEMPLATE = ("parity/report/html.py", "parity/report/page.py")


def stale_template(picture_time: int, template_times: dict[str, int]) -> list[str]:
  """The template files committed after the picture, each with both commit times, newest first."""
  newer = sorted(((t, p) for p, t in template_times.items() if t > picture_time), reverse=True)
  return [f"{p} (committed {t}) is newer than {PICTURE} (committed {picture_time})" for t, p in newer]


def _commit_time(path: str) -> int | None:
  r = subprocess.run(["git", "log", "-1", "--format=%ct", "--", path], cwd=ROOT, capture_output=True, text=True,
                     timeout=60)
  out = r.stdout.strip()
  return int(out) if r.returncode == 0 and out.isdigit() else None


def test_the_readme_picture_is_not_older_than_the_report_template():
  if shutil.which("git") is None or not (ROOT / ".git").exists():
    pytest.skip("not a git checkout: the commit times of the picture and the report template are unknown")
  times = {p: _commit_time(p) for p in (PICTURE, *TEMPLATE)}
  missing = [p for p, t in times.items() if t is None]
  if missing:
    pytest.skip(f"no commit of {', '.join(missing)} in this checkout's history (a shallow clone?)")
  picture = times.pop(PICTURE)
  stale = stale_template(picture, times)
  assert not stale, ("the README's picture is stale: " + "; ".join(stale) +
                     ". Take a new screenshot of report.html (docs/testing.md, 'The picture in the README').")


def test_a_template_committed_after_the_picture_is_named():
  assert stale_template(100, {"parity/report/html.py": 90, "parity/report/page.py": 100}) == []
  assert stale_template(100, {"parity/report/html.py": 90, "parity/report/page.py": 101}) == [
      f"parity/report/page.py (committed 101) is newer than {PICTURE} (committed 100)"]
