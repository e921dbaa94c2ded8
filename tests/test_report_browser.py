"""report.html as a person sees it: rendered by headless Chromium (Debian's `chromium`), no console errors, every
plot drawn, the verdict sentence on screen, a screenshot saved. Skipped, saying so, where Chromium is
not installed (.ci/run installs it where it can)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import requires_jax, requires_torch
from test_report_page import shared_run

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.slow, requires_jax, requires_torch,
              pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed: `apt-get install -y "
                                 "chromium` (Debian) to run the browser test of report.html")]
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--host-resolver-rules=MAP * ~NOTFOUND")
"""No GPU, no network (every host name fails to resolve: a page that needed one would show it), no profile sync."""


def chromium(page: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess:
  """Runs headless Chromium on `page` with FLAGS, a fresh profile under `tmp` and `args`; console messages on stderr."""
  cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={tmp / 'profile'}", "--enable-logging=stderr", "--v=0", *args,
         page.resolve().as_uri()]
  return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def console_errors(stderr: str) -> list[str]:
  """Lines of Chromium's log that are the page's console messages or failed loads (not the browser's own D-Bus or
  GPU chatter)."""
  return [ln for ln in stderr.splitlines()
          if re.search(r"CONSOLE\(\d+\)|Uncaught|Failed to load resource|net::ERR_", ln)]


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
  return shared_run(tmp_path_factory) / "report.html"


@pytest.mark.process
def test_the_page_renders_with_every_plot_and_no_console_error(page, tmp_path):
  r = chromium(page, tmp_path, "--dump-dom")
  assert r.returncode == 0, r.stderr[-2000:]
  assert console_errors(r.stderr) == []
  dom = r.stdout
  verdict = re.search(r'id="verdict"><strong>(.*?)</strong>', dom)
  assert verdict and verdict.group(1).startswith("PASS: jax and torch agree")
  figures = re.findall(r'<figure data-plot="(\w+)">(.*?)</figure>', dom, flags=re.S)
  assert len(figures) == 6, [k for k, _ in figures]
  for key, body in figures:  # parsed by the browser into an SVG element with drawn paths and a non-zero size
    size = re.search(r'<svg[^>]*\bwidth="([\d.]+)pt"[^>]*\bheight="([\d.]+)pt"', body)
    assert size and float(size.group(1)) > 100 and float(size.group(2)) > 100, key
    assert body.count("<path") >= 5, key


@pytest.mark.process
def test_screenshot_shows_a_drawn_page(page, tmp_path):
  import numpy as np
  from matplotlib import image
  shot = tmp_path / "report.png"
  r = chromium(page, tmp_path, f"--screenshot={shot}", "--window-size=1400,4000", "--hide-scrollbars")
  assert r.returncode == 0 and shot.exists(), r.stderr[-2000:]
  assert console_errors(r.stderr) == []
  px = image.imread(str(shot))[..., :3]
  assert px.shape[:2] == (4000, 1400)
  ink = (px.min(axis=2) < 0.5).mean(axis=1)  # share of dark pixels per row (plots are mostly white: 0.70 measured)
  assert (ink > 0.001).mean() > 0.5, "most of the page's height should carry text, tables or plots"
  banner = px[60:200, 100:1300].reshape(-1, 3)  # the verdict box: light green background on a PASS
  green = np.mean((banner[:, 1] > banner[:, 0] + 0.03) & (banner[:, 1] > banner[:, 2] + 0.01))
  assert green > 0.3, "the verdict box should be green on a pass"
