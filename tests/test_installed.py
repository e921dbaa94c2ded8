"""Install by extras (parity/installed.py, pyproject.toml): a side whose framework is not installed is refused by name
with its install line when the user named it (exit 2, before anything runs), and left out with one line when they
did not (the default sides), the way parity.sockets does for refused sockets; `parity doctor` says which framework
is missing instead of failing its probe. The in-process tests fake the detection (`installed.installed`); the slow one
installs `.[jax]` into a fresh virtualenv and runs there, where torch and deepspeed really are missing.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, requires_jax
from parity import installed
from parity.errors import SpecError


def _without(*modules: str):
  """installed.installed as on a machine where `modules` are not installed (the others are asked for real)."""
  real = installed.installed
  return lambda m: m not in modules and real(m)


PIP = f"{shlex.quote(sys.executable)} -m pip"
"""This interpreter's pip: the hints install into the Python parity runs in, activated or not."""
CLONE = f"cd {shlex.quote(str(ROOT))} && {PIP} install -c constraints.txt -e "
"""The install hint in this checkout (an editable install of a clone): the constrained install from its root."""


@pytest.fixture
def jax_only(monkeypatch):
  """This process sees no torch and no deepspeed (a `pip install 'parity[jax]'` machine)."""
  monkeypatch.setattr(installed, "installed", _without("torch", "deepspeed"))


def test_the_refusal_and_the_line_name_the_framework_and_the_extra():
  assert installed.refusal("torch", "torch") == ("side 'torch' needs PyTorch, which is not installed here: "
                                                 f"{CLONE}'.[torch]'")
  assert installed.refusal("deepspeed", "deepspeed").endswith("needs DeepSpeed, which is not installed here: "
                                                              f"{CLONE}'.[deepspeed]'")
  assert "FSDP2" in installed.refusal("fsdp", "torch") and "'.[torch]'" in installed.refusal("fsdp", "torch")
  assert installed.refusal("jax", "flax") == f"side 'jax' needs Flax, which is not installed here: {CLONE}'.[jax]'"
  assert installed.not_installed_line("deepspeed", "torch") == (
      "deepspeed: not run: PyTorch is not installed here, which the deepspeed side needs; the other sides run. "
      f"Install it with {CLONE}'.[deepspeed]'")


def test_the_install_hint_is_the_constrained_checkout_install_in_a_clone_and_the_extra_for_a_wheel(monkeypatch,
                                                                                                    tmp_path):
  """A clone's hint installs the measured versions from its root (`pip install 'parity[torch]'` there resolved to the
  newest torch and its CUDA wheels); an installed wheel's names the extra; every hint goes through pip_install."""
  assert installed.checkout_root() == ROOT
  assert installed.pip_install("torch") == f"{CLONE}'.[torch]'" == installed.install_line("torch")
  assert installed.pip_install(None) == CLONE + "."
  cuda = installed.pip_install("cuda", constrained=False)
  assert cuda == f"cd {shlex.quote(str(ROOT))} && {PIP} install -e '.[cuda]'"
  monkeypatch.setattr(installed, "checkout_root", lambda: None)  # a wheel in site-packages
  assert installed.install_line("torch") == f"{PIP} install 'parity[torch]'" and installed.pip_install(None) == \
      f"{PIP} install parity"
  assert installed.refusal("fsdp", "torch").endswith(f"which is not installed here: {PIP} install 'parity[torch]'")
  assert installed.not_installed_line("torch", "torch").endswith(f"Install it with {PIP} install 'parity[torch]'")
  assert installed.framework_record("torch", have=lambda m: False)["install"] == f"{PIP} install 'parity[torch]'"
  from harness import backend
  assert f"install it: {PIP} install 'parity[cuda]' (or" in backend._jax_problem({"jax": "0.10.2"}, {})
  from parity.cli.doctor import _not_installed
  torch_line = f"{PIP} install 'parity[torch]'"
  line = _not_installed({"missing": "torch", "sides": ["torch", "deepspeed"], "install": torch_line})
  assert line.endswith(f"{PIP} install 'parity[torch]' (the deepspeed side: {PIP} install 'parity[deepspeed]')")
  # the detection: the folder above parity/ with pyproject.toml and constraints.txt beside it
  fake = tmp_path / "clone"
  (fake / "parity").mkdir(parents=True)
  monkeypatch.undo()
  monkeypatch.setattr(installed, "__file__", str(fake / "parity" / "installed.py"))
  assert installed.checkout_root() is None
  (fake / "pyproject.toml").write_text("")
  assert installed.checkout_root() is None  # a source tree without the pins is not this project's checkout
  (fake / "constraints.txt").write_text("")
  assert installed.checkout_root() == fake.resolve()


def test_the_plan_drops_unnamed_sides_refuses_named_ones_and_refuses_when_none_is_left():
  sides = ("jax", "deepspeed", "torch")
  no_torch = _without("torch", "deepspeed")
  assert installed.plan_sides(sides, named=False, have=lambda m: True).sides == sides
  plan = installed.plan_sides(sides, named=False, have=no_torch)
  assert plan.sides == ("jax",) and list(plan.not_run) == ["deepspeed", "torch"]
  assert plan.not_run["torch"] == installed.not_installed_line("torch", "torch")
  with pytest.raises(SpecError) as e:
    installed.plan_sides(("jax", "torch", "fsdp"), named=True, have=no_torch)
  assert str(e.value) == "; ".join([installed.refusal("torch", "torch"), installed.refusal("fsdp", "torch")])
  with pytest.raises(SpecError, match=r"sides jax,deepspeed,torch: none can run here: jax needs JAX.*"
                                      r"-e '\.\[jax\]' \(or the extra torch, deepspeed or all in place of jax\)"):
    installed.plan_sides(sides, named=False, have=lambda m: False)
  only_ds_missing = installed.plan_sides(sides, named=False, have=_without("deepspeed"))
  assert only_ds_missing.sides == ("jax", "torch") and "DeepSpeed is not installed" in only_ds_missing.not_run[
      "deepspeed"]


@pytest.mark.parametrize("sides,words", [
    ("torch", f"side 'torch' needs PyTorch, which is not installed here: {CLONE}'.[torch]'"),
    ("jax,deepspeed", f"side 'deepspeed' needs PyTorch, which is not installed here: {CLONE}'.[deepspeed]'"),
    ("jax,fsdp", ("side 'fsdp' needs PyTorch (FSDP2 is part of it), which is not installed here: "
                  f"{CLONE}'.[torch]'"))])
def test_a_named_side_without_its_framework_is_refused_with_exit_2(jax_only, tmp_path, capsys, sides, words):
  from parity.cli import main
  out = tmp_path / "run"
  assert main(["compare", "--preset", "gpt2-tiny", "--steps", "2", "--sides", sides, "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert err.startswith("parity compare: error: ") and words in err
  assert not out.exists()  # refused before anything was made


def test_default_sides_leave_out_those_not_installed(jax_only, tmp_path, capsys, fake_sides):
  """No --sides on a JAX-only install: deepspeed and torch are left out with one line each, recorded as not run in
  report.json; jax runs (the fake worker of tests/test_pipeline.py: in-process, no framework), and the run, which
  compared nothing of what was asked, exits 3 saying so; `--sides jax` asks for one side: ONE SIDE, exit 0."""
  from parity.cli import main
  fake_sides()
  out = tmp_path / "run"
  code = main(["compare", "--preset", "gpt2-tiny", "--steps", "4", "--determinism-steps", "0", "--no-progress",
               "--out", str(out)])
  said = capsys.readouterr()
  err = said.err
  lines = {s: installed.not_installed_line(s, "torch") for s in ("deepspeed", "torch")}
  assert [ln for ln in err.splitlines() if "not run:" in ln] == [f"parity compare: {ln}" for ln in lines.values()]
  rep = json.loads((out / "report.json").read_text())
  assert code == 3, rep["verdict"]
  assert rep["verdict"]["message"].startswith("ONE SIDE: jax ran ok")
  assert ("incomplete: 1 of 3 asked sides ran (jax); left out: deepspeed (PyTorch is not installed here), torch "
          "(PyTorch is not installed here); exit code 3.") in " ".join(said.out.split())
  assert rep["run"]["sides"] == ["jax"] and list(rep["sides"]) == ["jax"]
  assert rep["sides_not_run"] == {s: {"reason": ln, "named": False} for s, ln in lines.items()}
  env = json.loads((out / "environment.json").read_text())
  assert env["frameworks"]["torch"]["installed"] is False  # the quick block records it, no probe
  one = tmp_path / "one"
  assert main(["compare", "--preset", "gpt2-tiny", "--steps", "4", "--determinism-steps", "0", "--no-progress",
               "--sides", "jax", "--out", str(one)]) == 0
  assert "incomplete" not in capsys.readouterr().out


def test_default_sides_with_no_framework_are_refused(monkeypatch, tmp_path, capsys):
  from parity.cli import main
  monkeypatch.setattr(installed, "installed", lambda m: False)
  out = tmp_path / "run"
  assert main(["compare", "--preset", "gpt2-tiny", "--steps", "2", "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert "none can run here" in err and f"{CLONE}'.[jax]'" in err and not out.exists()


def test_doctor_says_not_installed_instead_of_a_failed_probe(jax_only, monkeypatch):
  from harness import doctor
  from parity.cli.doctor import rows
  monkeypatch.setattr(doctor, "run_probe", lambda *a, **k: pytest.fail("a missing framework was probed"))
  probes = doctor.probe_frameworks(("torch",))
  assert probes == {"torch": {"installed": False, "missing": "torch", "install": f"{CLONE}'.[torch]'",
                              "sides": ["torch", "fsdp", "deepspeed"]}}
  block = doctor.environment_block(quick=True, frameworks={"jax": {"error": "x"}, **probes})
  (row,) = [v for k, v in rows(block) if k == "torch"]
  assert row.startswith("not installed (torch missing): the torch, fsdp, deepspeed side(s) cannot run here; "
                        f"{CLONE}'.[torch]'") and f"{CLONE}'.[deepspeed]'" in row
  assert not any(v.startswith("PROBE FAILED") for k, v in rows(block) if k == "torch")


# ------------------------------------------------------------------------------------------- a real JAX-only install
_COPY = ("parity", "harness", "jax_impl", "torch_impl", "pyproject.toml", "README.md", "constraints.txt")
"""What a `pip install -e .` of the checkout reads (copied, so the install writes its egg-info outside the checkout)."""


def _run(cmd: list, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
  return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                        check=False)


@pytest.mark.process
@pytest.mark.slow
@requires_jax
def test_a_jax_only_install_runs_jax_and_refuses_torch_by_name(tmp_path):
  """`python -m venv` (no system site-packages) + `pip install -c constraints.txt -e '.[jax]'` of a copy of this
  checkout: torch and deepspeed are not installed there, `parity compare --sides jax` runs (exit 0) and `--sides
  torch` is refused naming the constrained install of that copy's `torch` extra (exit 2). Measured on a 2-core
  machine under load 7 with the local package index: venv 9 s, the install 63 s, the jax compare 24 s; the whole
  test 75 s, so it runs by default (slow, process). It needs the package index pip is configured with (the one the
  README's install uses). (requires_jax: jax's wheels come from the index, but a machine without jax cannot be
  expected to reach them.)"""
  src = tmp_path / "src"
  src.mkdir()
  for name in _COPY:
    p = ROOT / name
    if p.is_dir():
      shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    else:
      shutil.copy2(p, src / name)
  venv = tmp_path / "venv"
  py = venv / "bin" / "python"
  t0 = time.monotonic()
  done = _run([sys.executable, "-m", "venv", venv], tmp_path, 300)
  assert done.returncode == 0, done.stderr[-2000:]
  done = _run([py, "-m", "pip", "install", "-q", "-c", "constraints.txt", "-e", ".[jax]"], src, 900)
  install_s = time.monotonic() - t0
  assert done.returncode == 0, f"pip install failed after {install_s:.0f} s: {done.stderr[-3000:]}"
  for module in ("torch", "deepspeed"):
    p = _run([py, "-c", f"import {module}"], tmp_path, 120)
    assert p.returncode != 0 and f"No module named '{module}'" in p.stderr, (module, p.stderr[-500:])
  parity = venv / "bin" / "parity"
  common = ["compare", "--preset", "gpt2-tiny", "--steps", "2", "--determinism-steps", "0", "--no-progress"]
  ok = _run([parity, *common, "--sides", "jax", "--out", tmp_path / "jax"], tmp_path, 600)
  assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
  assert json.loads((tmp_path / "jax" / "report.json").read_text())["sides"]["jax"]["status"] == "ok"
  no = _run([parity, *common, "--sides", "torch", "--out", tmp_path / "torch"], tmp_path, 300)
  assert no.returncode == 2 and "side 'torch' needs PyTorch, which is not installed here: cd " in no.stderr \
      and f"{src.resolve()} && " in no.stderr and "-m pip install -c constraints.txt -e '.[torch]'" in no.stderr, \
      no.stderr[-2000:]
  assert not (tmp_path / "torch").exists()
