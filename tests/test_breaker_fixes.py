"""The breaker's failures on the issue-#11 work, one test per failure class (each fails on the code before the fix).

1. a YAML alias bomb is refused at once (values walked are capped by the text's length); Ctrl-C before any side
   started says so instead of claiming a report marks a killed side.
2. kill -9 of the parity process leaves nothing of its worker's tree: not the worker, not a grandchild in a process
   group of its own (ninja's compilers).
3. `parity report` recomputes the verdict from the stored checks and re-hashes the artifacts it rests on.
4. messages: unreadable lock, empty config, NaN, a diagnose folder, plan flags named, --out inside a run.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import process_alive as _alive

ROOT = Path(__file__).resolve().parents[1]


def _parity(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "parity.cli", *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout)


# ----------------------------------------------------------------------------- 1


def _bomb(path: Path, levels: int) -> Path:
  lines, prev = ["w: &w [1, 2, 3, 4, 5, 6, 7, 8, 9]"], "w"
  for i in range(levels):
    lines.append(f"l{i}: &l{i} [" + ", ".join([f"*{prev}"] * 9) + "]")
    prev = f"l{i}"
  path.write_text("\n".join(lines) + "\n")
  return path


def test_yaml_alias_bomb_is_refused_at_once(tmp_path):
  """9 levels of 9 aliases (9^9 values from ~400 characters) -> bad input naming the file, within seconds."""
  from parity.inputs import InputError, parse_text
  bomb = _bomb(tmp_path / "bomb.yaml", 9)
  t0 = time.time()
  with pytest.raises(InputError, match="alias"):
    parse_text(bomb.read_text(), str(bomb), "yaml")
  assert time.time() - t0 < 2.0
  r = _parity("compare", "--config", str(bomb), "--out", str(tmp_path / "run"), "--steps", "4", timeout=30)
  assert r.returncode == 2 and str(bomb) in r.stderr and "alias" in r.stderr, r.stderr


def test_aliases_that_do_not_expand_past_the_text_still_load(tmp_path):
  """The rule refuses expansion, not aliases: a small anchor reused twice loads as before."""
  from parity.inputs import parse_text
  text = "base: &b {lr: 0.001, steps: 4}\na: *b\nb: *b\n"
  assert parse_text(text, "ok.yaml", "yaml")["b"] == {"lr": 0.001, "steps": 4}


def test_interrupt_before_any_side_started_says_so(monkeypatch, capsys):
  """Ctrl-C while resolving (no worker ever started): the message does not claim a killed side or a report."""
  from parity import cli

  def interrupted(args):
    raise KeyboardInterrupt
  monkeypatch.setattr("harness.lifetime._started", 0)
  parser = cli.build_parser
  monkeypatch.setattr(cli, "build_parser", lambda: _with_handler(parser(), interrupted))
  assert cli.main(["compare", "--preset", "gpt2-tiny"]) == 130
  err = capsys.readouterr().err
  assert "before any side started" in err and "report marks" not in err, err


def _with_handler(ap, handler):
  ap.set_defaults(handler=handler)
  for action in ap._actions:
    if hasattr(action, "choices") and isinstance(action.choices, dict):
      for sub in action.choices.values():
        sub.set_defaults(handler=handler)
  return ap


# ----------------------------------------------------------------------------- 2


def _fake_build_tree(tmp_path: Path, hold_pipe: bool) -> tuple[subprocess.Popen, int, int, int | None]:
  """A fake `parity build-ops`: a process that spawns a worker through harness.boot; the worker starts a grandchild
  in a session of its own, as ninja starts its compilers, then waits in subprocess.run (as torch's cpp_extension
  waits on ninja). With `hold_pipe`, a forked helper keeps the binding pipe's write end open after the parent dies,
  so only the kernel's parent-death signal can end the worker. Returns (parent, worker, grandchild, helper)."""
  (tmp_path / "fakebuild.py").write_text(textwrap.dedent("""
    import subprocess
    child = subprocess.Popen(["sleep", "300"], start_new_session=True)
    print(child.pid, flush=True)
    subprocess.run(["sleep", "300"])
  """))
  (tmp_path / "fakeparity.py").write_text(textwrap.dedent(f"""
    import os, subprocess, sys, time
    sys.path.insert(0, {str(ROOT)!r})
    from harness import lifetime
    from harness.env import worker_env
    env = worker_env({{"PYTHONPATH": {str(tmp_path)!r} + ":" + {str(ROOT)!r}}})
    proc = lifetime.spawn([sys.executable, "-m", "harness.boot", "fakebuild"], env=env, timeout_s=600,
                          stdout=subprocess.PIPE)
    helper = 0
    if {hold_pipe!r}:
      helper = os.fork()
      if helper == 0:  # holds every fd of the parent, the pipe's write end included
        time.sleep(60)
        os._exit(0)
    print(proc.pid, proc.stdout.readline().decode().strip(), helper, flush=True)
    proc.wait()
  """))
  parent = subprocess.Popen([sys.executable, str(tmp_path / "fakeparity.py")], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
  worker, grandchild, helper = (int(x) for x in parent.stdout.readline().split())
  return parent, worker, grandchild, helper or None


@pytest.mark.slow
@pytest.mark.parametrize("hold_pipe", [True, False], ids=["parent-death-signal-only", "signal-and-pipe"])
def test_kill_9_of_parity_leaves_no_grandchild_in_its_own_group(tmp_path, hold_pipe):
  """kill -9 of the process that spawned the worker: within 5 s neither the worker nor its grandchild in a group of
  its own runs. With the pipe held open elsewhere the old SIGKILL parent-death signal always orphaned the
  grandchild (the worker died before it could kill it); without, the pipe watcher only sometimes won that race."""
  parent, worker, grandchild, helper = _fake_build_tree(tmp_path, hold_pipe)
  try:
    time.sleep(0.5)  # the worker is in subprocess.run now
    assert _alive(worker) and _alive(grandchild)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    t_end = time.time() + 5.0
    while time.time() < t_end and (_alive(worker) or _alive(grandchild)):
      time.sleep(0.1)
    left = [p for p in (worker, grandchild) if _alive(p)]
    assert not left, f"still running after kill -9 of their parity process: {left}"
  finally:
    for p in (worker, grandchild, helper):
      if p and _alive(p):
        os.kill(p, signal.SIGKILL)


# ----------------------------------------------------------------------------- 4


@pytest.mark.parametrize("text,fmt,match", [
    ("", "yaml", "the file is empty"), ("  \n\n", "hjson", "the file is empty"),
    ("# only a comment\n", "yaml", "holds no config"),
    ('{\n"lr": NaN}\n', "hjson", "2: key 'lr' is NaN: NaN and Infinity are not allowed"),
    ('{"optimizer": {"params": {"lr": -Infinity}}}', "hjson", "key 'lr' is -Infinity"),
    ('{"a": [1, Infinity]}', "hjson", "a value is Infinity"),
])
def test_empty_and_nonfinite_configs_are_named(text, fmt, match):
  from parity.inputs import InputError, parse_text
  with pytest.raises(InputError, match=match):
    parse_text(text, "cfg", fmt)


def test_quoted_nan_text_is_not_a_number():
  """A string that happens to read NaN or mention inf is a string, not a refused number."""
  from parity.inputs import parse_text
  assert parse_text('{"name": "NaN", "desc": "the inf value", "x": "Infinity"}', "c", "hjson")["name"] == "NaN"


# ----------------------------------------------------------------------------- 3


def _run_folder(tmp_path: Path) -> Path:
  """A finished run folder as `parity compare` leaves it: artifacts, and a report.json recording their hashes."""
  import json
  from parity.verdict.check import Check
  from parity.verdict.sides import verdict
  from parity.report.build import REPORT_SCHEMA, artifact_hashes
  rd = tmp_path / "run"
  for rel in ("request.json", "init.safetensors", "batches.npy", "jax/steps.jsonl", "jax/final.safetensors",
              "torch/steps.jsonl", "torch/final.safetensors"):
    (rd / rel).parent.mkdir(parents=True, exist_ok=True)
    (rd / rel).write_bytes(rel.encode() * 50)
  checks = [Check("loss jax~torch", "loss", ("jax", "torch"), 1e-6, 1e-4, True),
            Check("determinism jax", "determinism", ("jax", "jax"), 0.0, 0.0, True, gating=False)]
  statuses = {"jax": "ok", "torch": "ok"}
  side = {"status": "ok", "summary": {}, "series": {"loss": [], "val_loss": []}}
  data = {"schema": REPORT_SCHEMA, "verdict": verdict(checks, statuses).to_json(),
          "checks": [c.to_json() for c in checks], "sides": {s: dict(side) for s in statuses},
          "artifacts": artifact_hashes(rd, list(statuses))}
  (rd / "report.json").write_text(json.dumps(data))
  return rd


def test_report_recomputes_the_verdict_from_its_checks(tmp_path):
  import json
  from parity.report.read import load_report, verify_report
  rd = _run_folder(tmp_path)
  assert load_report(rd).passed and verify_report(load_report(rd)) == []
  data = json.loads((rd / "report.json").read_text())
  data["checks"][0]["passed"] = False  # the check edited, the stored verdict left saying PASS
  (rd / "report.json").write_text(json.dumps(data))
  problems = verify_report(load_report(rd))
  assert len(problems) == 1 and "stored verdict says PASS" in problems[0] and "edited" in problems[0]
  r = _parity("report", str(rd))
  assert r.returncode == 1 and "edited or is inconsistent" in r.stderr and "PASS" not in r.stdout, r


@pytest.mark.parametrize("change,said", [
    (lambda p: p.write_bytes(p.read_bytes()[:10]), "torch/final.safetensors (1150 -> 10 bytes)"),
    (lambda p: p.write_bytes(p.read_bytes()[::-1]), "torch/final.safetensors (same size, different content)"),
    (lambda p: p.unlink(), "torch/final.safetensors (missing)"),
])
def test_report_names_an_artifact_changed_since_the_run(tmp_path, change, said):
  from parity.report.read import load_report, verify_report
  rd = _run_folder(tmp_path)
  change(rd / "torch" / "final.safetensors")
  problems = verify_report(load_report(rd))
  assert len(problems) == 1 and said in problems[0], problems
  r = _parity("report", str(rd))
  assert r.returncode == 1 and said in r.stderr, r.stderr


@pytest.mark.parametrize("content", ["garbage{", "", "[1, 2]", '{"pid": 5}'])
def test_unreadable_lock_is_named_not_taken_for_another_host(tmp_path, content):
  from parity.pipeline.claim import LOCK_NAME, RunFolderError, claim_run_dir
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / LOCK_NAME).write_text(content)
  with pytest.raises(RunFolderError, match=r"lock file .*\.parity\.lock cannot be read .* remove that file") as e:
    claim_run_dir(tmp_path / "run")
  assert "another host" not in str(e.value) and "pid ?" not in str(e.value)


def _diagnose_folder(tmp_path: Path) -> Path:
  d = tmp_path / "dg"
  d.mkdir()
  (d / "request.json").write_text('{"schema": "parity.request/1"}')
  (d / "diagnose.json").write_text('{"schema": "parity.diagnose/1"}')
  (d / "diagnose.md").write_text("# diagnose\n")
  return d


def test_a_diagnose_folder_is_named_as_one(tmp_path):
  from parity.pipeline.claim import RunFolderError, claim_run_dir
  from parity.inputs import InputError
  from parity.report.read import load_report
  d = _diagnose_folder(tmp_path)
  with pytest.raises(RunFolderError, match="holds a diagnose run"):
    claim_run_dir(d)
  with pytest.raises(InputError, match=r"holds a `parity diagnose` run.*diagnose\.md"):
    load_report(d)


@pytest.mark.parametrize("marker,inner", [
    ("report.json", "jax/nested"), ("request.json", "a/b/c"), (".parity.lock", "x"), ("diagnose.json", "torch")])
def test_out_inside_a_run_folder_is_refused(tmp_path, marker, inner):
  from parity.pipeline.claim import RunFolderError, claim_run_dir
  run = tmp_path / "base"
  run.mkdir()
  (run / marker).write_text('{"schema": "parity.x/1", "pid": 1, "host": "h"}')
  with pytest.raises(RunFolderError, match=f"inside the parity run folder {run}"):
    claim_run_dir(run / inner)
  assert not (run / inner).exists()


def test_out_next_to_a_run_or_under_a_users_config_is_accepted(tmp_path):
  """Only parity's own files mark a run: a project folder with its own config.json/report.json is not one."""
  from parity.pipeline.claim import claim_run_dir
  (tmp_path / "config.json").write_text("{}")
  (tmp_path / "report.json").write_text('{"schema": "mine"}')
  claim = claim_run_dir(tmp_path / "runs" / "one")
  claim.release()


@pytest.mark.parametrize("argv,said", [
    (["plan", "--host-memory", "1e400"], "parity plan: error: --host-memory 1e400: must be a finite number"),
    (["plan", "--peak-tflops=-1e999"], "parity plan: error: --peak-tflops -1e999: must be a finite number"),
    (["plan", "--host-memory", "-1"], "parity plan: error: --host-memory -1: must be a number > 0"),
    (["plan", "--devices", "0"], "parity plan: error: devices (--devices) 0: must be >= 1"),
    (["estimate", "--model", "nope"], "parity estimate: error: unknown model preset 'nope'"),
])
def test_sizing_flags_are_named_as_typed(argv, said):
  r = _parity(*argv)
  assert r.returncode == 2 and r.stderr.startswith(said), r.stderr
