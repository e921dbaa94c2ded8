"""What a new user meets on a clean clone: a compare that left sides out exits 3 and says so, the README's join recipe
keeps the checkout clean, and the terminal says when DeepSpeed's ops are about to be built. All in-process: the
compare runs use test_pipeline's fake worker (no framework, no process)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import ROOT
from parity import buildenv, installed, sockets
from parity.report.build import EXIT_INCOMPLETE, Report, exit_code
from parity.report.progress import op_build_line, show_op_build
from parity.spec import RunSpec

NOT_INSTALLED = "{s}: not run: PyTorch is not installed here, which the {s} side needs; the other sides run. Install it"


def _report(passed: bool, ran: list[str], left_out: list[str], *, named: bool = False, **extra) -> Report:
  """A Report as build_report writes it, with only what the exit code reads."""
  data = {"verdict": {"passed": passed, "message": "PASS" if passed else "FAIL: loss"},
          "sides": {s: {"status": "ok"} for s in ran},
          "sides_not_run": {s: {"reason": NOT_INSTALLED.format(s=s), "named": named} for s in left_out}, **extra}
  return Report(data, Path("runs/x"))


# ------------------------------------------------------------------------------------------ exit 3: incomplete


def test_exit_code_rule_incomplete_is_3_and_fail_comes_first():
  assert EXIT_INCOMPLETE == 3
  assert exit_code(passed=True, asked=3, ran=3) == 0
  assert exit_code(passed=True, asked=3, ran=1) == 3
  assert exit_code(passed=False, asked=3, ran=1) == 1  # a failed verdict keeps its 1
  assert exit_code(passed=True, asked=1, ran=1) == 0  # `--sides jax`: one side asked, ONE SIDE


def test_a_report_that_left_default_sides_out_exits_3_and_says_which_and_why():
  rep = _report(True, ["jax"], ["deepspeed", "torch"])
  assert rep.exit_code == 3 and list(rep.left_out) == ["deepspeed", "torch"]
  line = rep.incomplete_line()
  assert line.startswith("incomplete: 1 of 3 asked sides ran (jax); left out: deepspeed (PyTorch is not installed "
                         "here), torch (PyTorch is not installed here); exit code 3.")
  assert "--sides jax" in line
  assert _report(False, ["jax", "torch"], ["deepspeed"]).exit_code == 1
  assert _report(True, ["jax", "torch"], ["deepspeed"], write_errors=[{"file": "x", "error": "y"}]).exit_code == 1
  full = _report(True, ["jax", "deepspeed", "torch"], [])
  assert full.exit_code == 0 and full.incomplete_line() is None
  # a named side is never left out: kept and recorded not run (its verdict fails), so it is not 'incomplete'
  named = _report(False, ["jax", "deepspeed"], ["deepspeed"], named=True)
  assert named.left_out == {} and named.exit_code == 1
  refused = sockets.not_run_line("deepspeed", "[Errno 1] Operation not permitted")
  socks = Report({"verdict": {"passed": True}, "sides": {"jax": {}, "torch": {}},
                  "sides_not_run": {"deepspeed": {"reason": refused, "named": False}}}, Path("runs/x"))
  assert socks.exit_code == 3 and "left out: deepspeed (this machine refuses sockets (" in socks.incomplete_line()


def test_the_cli_exits_3_on_default_sides_and_0_on_one_named_side(monkeypatch, tmp_path, capsys, fake_sides):
  """No torch here: the default sides run jax alone (ONE SIDE) and exit 3 with the line; `--sides jax` exits 0."""
  from parity.cli import main
  real = installed.installed
  monkeypatch.setattr(installed, "installed", lambda m: m not in ("torch", "deepspeed") and real(m))
  fake_sides()
  common = ["compare", "--preset", "gpt2-tiny", "--steps", "4", "--determinism-steps", "0", "--no-progress"]
  assert main([*common, "--out", str(tmp_path / "all")]) == 3
  out = " ".join(capsys.readouterr().out.split())
  assert "ONE SIDE: jax ran ok" in out and "incomplete: 1 of 3 asked sides ran (jax)" in out and "exit code 3" in out
  assert main([*common, "--sides", "jax", "--out", str(tmp_path / "one")]) == 0
  out = capsys.readouterr().out
  assert "ONE SIDE: jax ran ok" in " ".join(out.split()) and "incomplete" not in out


# ------------------------------------------------------------------------------------- the join recipe in runs/

DOCS = ("README.md", "docs/join.md", "docs/tpu.md")


def _join_folders(text: str) -> list[str]:
  """Every folder the `parity join` recipe's commands write or read: --out, --request's folder, join's folders."""
  found = re.findall(r"--out (\S+?)[`\s]", text) + re.findall(r"--request (\S+?)/request\.json", text)
  for args in re.findall(r"parity join ((?:[^\s`#-]\S*\s+)+)", text):
    found += args.split()
  return [f for f in found if not re.fullmatch(r"[A-Z]{3,}\]?", f)]  # DIR: a placeholder


@pytest.mark.parametrize("doc", DOCS)
def test_the_join_recipe_writes_under_runs_which_git_ignores(doc):
  text = (ROOT / doc).read_text()
  folders = _join_folders(text)
  assert "runs/A" in folders and "runs/AB" in folders, (doc, folders)
  outside = [f for f in folders if not f.startswith(("runs/", "/"))]
  assert not outside, f"{doc}: folders outside runs/ would be left untracked in the checkout: {outside}"
  assert "runs/" in (ROOT / ".gitignore").read_text().split()


# --------------------------------------------------------------------------- the line before DeepSpeed's op build


def test_the_op_build_line_is_said_only_when_the_ops_are_missing(monkeypatch, tmp_path, capsys):
  monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # the real check, on an empty extensions folder
  spec = RunSpec()  # the default DeepSpeed plan: offload_optimizer cpu, AdamW
  monkeypatch.setattr("parity.environment.cuda_evidence", lambda *a: None)  # DeepSpeed's CPU accelerator
  assert buildenv.deepspeed_ops(spec, cuda=False) == ("deepspeed_shm_comm", "cpu_adam")
  assert buildenv.missing_ops(("cpu_adam", "deepspeed_shm_comm")) == ["cpu_adam", "deepspeed_shm_comm"]
  show_op_build("deepspeed", spec)
  err = capsys.readouterr().err
  assert "parity compare: deepspeed: building DeepSpeed's C++ ops once (deepspeed_shm_comm, cpu_adam): a few " \
         "minutes on a fresh machine" in err and "later runs reuse them" in err and len(err.splitlines()) == 1
  show_op_build("torch", spec)  # no DeepSpeed in its worker
  show_op_build("jax", spec)
  assert capsys.readouterr().err == ""
  for op in ("cpu_adam", "deepspeed_shm_comm"):
    (tmp_path / op).mkdir()
    (tmp_path / op / f"{op}.so").write_bytes(b"")
  assert buildenv.missing_ops(("cpu_adam", "deepspeed_shm_comm")) == []
  show_op_build("deepspeed", spec)
  assert capsys.readouterr().err == ""
  assert op_build_line([]) is None


@pytest.mark.parametrize("built", [False, True])
def test_compare_says_it_builds_the_ops_before_the_deepspeed_side_starts(monkeypatch, tmp_path, capsys, fake_sides,
                                                                         built):
  """The pipeline says it once, right before the deepspeed side's worker starts, when its ops are reported missing;
  nothing when they are built."""
  from parity.cli import main
  monkeypatch.setattr(installed, "installed", lambda m: True)
  monkeypatch.setattr(sockets, "loopback_refusal", lambda: None)
  monkeypatch.setattr(buildenv, "missing_ops", lambda ops, environ=None: [] if built else list(ops))
  fake_sides()
  out = tmp_path / "run"
  main(["compare", "--preset", "gpt2-tiny", "--steps", "4", "--determinism-steps", "0", "--no-progress",
        "--sides", "jax,deepspeed", "--out", str(out)])
  lines = [ln for ln in capsys.readouterr().err.splitlines() if "building DeepSpeed's C++ ops once" in ln]
  assert len(lines) == (0 if built else 1), lines
  assert json.loads((out / "report.json").read_text())["run"]["sides"] == ["jax", "deepspeed"]
