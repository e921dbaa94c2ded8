"""The CLI's path arguments as a user meets them: every argument that names a file or folder, each wrong kind of path
(too long, a file for a folder, no permission) exits 2 naming the argument, before anything runs or is written."""
from __future__ import annotations

import json

import pytest

from parity.cli import build_parser, main
from test_cli import COMMANDS, _run, _subparsers


# ----------------------------------------------------------------------------------------- paths the user gives
PATH_ARGUMENTS = {
    "compare": {"config", "data", "out", "hf_model", "tokenizer", "deepspeed_config", "hostfile", "baseline",
                "request"},
    "report": {"run_dirs", "out"}, "check": {"new", "baseline"}, "join": {"run_dirs", "out"},
    "diagnose": {"config", "hf_model", "out"},
    "estimate": {"config", "json"}, "plan": {"config", "json"}, "presets": set(),
    "port": {"config", "output", "report_json", "report_md"}, "convert-weights": {"src", "dst", "spec"},
    "build-ops": set(), "doctor": {"json"},
}
"""Every argument of every command that names a file or folder (parity.cli._common.PATH_ARGS by command)."""


def _path_cases():
  """(command, dest, argv builder) for every path argument of every command, with placeholders for the rest."""
  from parity.cli._common import PATH_ARGS
  cases = []
  for command, sub in _subparsers(build_parser()).items():
    for a in sub._actions:
      if a.dest not in PATH_ARGS:
        continue
      def argv(value, sub=sub, a=a, command=command):
        out = [command]
        for b in sub._actions:
          if not b.option_strings and b.dest != "help":  # positionals: the one under test, or a placeholder
            out.append(value if b is a else "placeholder")
        return out + ([max(a.option_strings, key=len), value] if a.option_strings else [])
      cases.append((command, a.dest, argv))
  return cases


def test_the_path_arguments_are_the_ones_listed():
  """A new argument that names a file joins PATH_ARGS (and this list), so the checks below cover it."""
  found: dict[str, set] = {c: set() for c in COMMANDS}
  for command, dest, _ in _path_cases():
    found[command].add(dest)
  assert found == PATH_ARGUMENTS


@pytest.mark.parametrize("shape", ["name over 255 bytes", "path over PATH_MAX"])
@pytest.mark.parametrize("command, dest, argv", _path_cases(), ids=[f"{c}-{d}" for c, d, _ in _path_cases()])
def test_a_path_too_long_for_the_os_is_bad_input_naming_the_argument(command, dest, argv, shape, tmp_path, capsys):
  """Was an internal error (OSError ENAMETOOLONG) in compare --out/--data/--config, report and port: exit 2, one
  line naming the argument, before anything runs or is written."""
  value = str(tmp_path / ("a" * 300)) if shape.startswith("name") else str(tmp_path) + "/b" * 2100
  assert main(argv(value)) == 2
  err = capsys.readouterr().err
  flag = next(a for a in _subparsers(build_parser())[command]._actions if a.dest == dest)
  name = max(flag.option_strings, key=len) if flag.option_strings else flag.metavar or dest.upper()
  assert err.startswith(f"parity {command}: error: {name} {str(tmp_path)[:20]}"), err
  assert ("has a name of 300 bytes" if shape.startswith("name") else "bytes long, over the 4095") in err, err
  assert err.count("\n") == 1 and "internal error" not in err
  assert list(tmp_path.iterdir()) == []


@pytest.fixture
def bad_paths(tmp_path):
  """A folder, a file, a DeepSpeed config and canonical weights to point arguments at."""
  from parity import hf, weights
  from parity.presets import PRESETS
  (tmp_path / "adir").mkdir()
  (tmp_path / "afile").write_text("x")
  (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": {
      "type": "AdamW", "params": {"lr": 1e-3}}}))
  spec = PRESETS["gpt2-tiny"].model
  hf.save_canonical(tmp_path / "w.safetensors", weights.init_params(spec, seed=0), spec)
  return tmp_path


@pytest.mark.parametrize("argv, said", [
    # a folder where a file is expected (estimate/plan --json exited 1)
    (["estimate", "--preset", "gpt2-tiny", "--json", "{P}/adir"], "--json {P}/adir: cannot write (Is a directory)"),
    (["plan", "--preset", "gpt2-tiny", "--json", "{P}/adir"], "--json {P}/adir: cannot write (Is a directory)"),
    (["compare", "--preset", "gpt2-tiny", "--config", "{P}/adir"], "config {P}/adir is a folder; pass a file"),
    (["port", "{P}/ds.json", "--report-json", "{P}/adir"], "--report-json {P}/adir: is a folder"),
    # a file where a folder is expected (port -o/--report-md and convert-weights --to hf exited 1)
    (["port", "{P}/ds.json", "--quiet", "-o", "{P}/afile/o.yaml"],
     "--output {P}/afile/o.yaml: {P}/afile is a file where a folder is expected"),
    (["port", "{P}/ds.json", "--quiet", "--report-md", "{P}/afile/r.md"],
     "--report-md {P}/afile/r.md: {P}/afile is a file where a folder is expected"),
    (["estimate", "--preset", "gpt2-tiny", "--json", "{P}/afile/e.json"],
     "--json {P}/afile/e.json: {P}/afile is a file where a folder is expected"),
    (["plan", "--preset", "gpt2-tiny", "--json", "{P}/nofolder/p.json"],
     "--json {P}/nofolder/p.json: folder {P}/nofolder does not exist"),
    (["convert-weights", "{P}/w.safetensors", "{P}/afile/o.safetensors"],
     "DST {P}/afile/o.safetensors: {P}/afile is a file where a folder is expected"),
    (["convert-weights", "{P}/w.safetensors", "{P}/afile/hf", "--to", "hf"],
     "DST {P}/afile/hf: {P}/afile is a file where a folder is expected"),
    (["compare", "--preset", "gpt2-tiny", "--out", "{P}/afile/run"], "--out {P}/afile/run: cannot create"),
    (["report", "{P}/afile/run"], "{P}/afile/run is not a folder"),
    # a NUL byte (only a caller in Python can pass one; argv cannot hold it): was "embedded null byte", unnamed
    (["port", "{P}/d\0s.json"], "CONFIG {P}/d\0s.json: holds a NUL byte"),
    (["report", "{P}/r\0un"], "RUN_DIR {P}/r\0un: holds a NUL byte"),
    (["compare", "--preset", "gpt2-tiny", "--data", "{P}/d\0ata"], "--data {P}/d\0ata: holds a NUL byte"),
    (["convert-weights", "{P}/w.safetensors", "{P}/o.safetensors", "--spec", "{P}/s\0pec"],
     "--spec {P}/s\0pec: holds a NUL byte"),
])
def test_a_path_of_the_wrong_kind_is_bad_input_naming_it(bad_paths, argv, said):
  rc, err = _run([a.replace("{P}", str(bad_paths)) for a in argv])
  assert rc == 2 and f"error: {said.replace('{P}', str(bad_paths))}" in err, err
  assert err.count("\n") == 1 and "internal error" not in err


def test_a_path_too_long_inside_a_config_is_bad_input(tmp_path):
  """`data:` in a config file is no argument: the path itself is named (was an internal error)."""
  long = str(tmp_path / ("a" * 300))
  (tmp_path / "c.yaml").write_text(f"data: {long}\n")
  rc, err = _run(["compare", "--preset", "gpt2-tiny", "--config", str(tmp_path / "c.yaml"), "--out",
                  str(tmp_path / "r")])
  assert rc == 2 and err.startswith(f"parity compare: error: {long[:40]}") and "file name too long" in err, err


_UNPRIVILEGED = """
import contextlib, ctypes, io, json, os, sys
if os.geteuid() == 0:  # root: capset(2) to none, so that file permissions bind this process (no CAP_DAC_OVERRIDE)
  class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
  class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
  if ctypes.CDLL(None, use_errno=True).capset(ctypes.byref(Header(0x20080522, 0)), ctypes.byref((Data * 2)())):
    sys.exit("capset failed")
from parity.cli import main
out = []
for argv in json.load(sys.stdin):
  err = io.StringIO()
  with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    out.append([main(argv), err.getvalue()])
print(json.dumps(out))
"""
"""Runs `parity` commands (JSON list of argv on stdin) where file permissions apply, also for root: a new process
(not a fork of this multithreaded one) that drops its capabilities first; prints [[exit code, stderr], ...]."""


def _unprivileged(cases: list[list[str]]) -> list[list]:
  import subprocess
  import sys
  from pathlib import Path
  root = Path(__file__).resolve().parents[1]
  p = subprocess.run([sys.executable, "-c", _UNPRIVILEGED], input=json.dumps(cases), capture_output=True, text=True,
                     cwd=root, timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]
  return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.process
def test_permission_denied_is_bad_input_naming_the_argument(bad_paths):
  """An unreadable input and an unwritable output folder, on each command that reads or writes one: exit 2
  naming the argument (estimate --json, port -o and compare --out exited 1; convert-weights was an internal error,
  safetensors' own exception)."""
  import os
  import shutil
  import tempfile
  base = tempfile.mkdtemp(prefix="parity-perm-")
  try:
    os.chmod(base, 0o755)
    for name in ("ds.json", "w.safetensors"):
      shutil.copy(bad_paths / name, base)
      os.chmod(os.path.join(base, name), 0o644)
    shutil.copy(bad_paths / "ds.json", os.path.join(base, "secret.json"))
    os.chmod(os.path.join(base, "secret.json"), 0o000)
    os.mkdir(os.path.join(base, "ro"), 0o555)
    os.chmod(os.path.join(base, "ro"), 0o555)
    os.mkdir(os.path.join(base, "locked"), 0o000)
    os.chmod(os.path.join(base, "locked"), 0o000)
    cases = [(["compare", "--preset", "gpt2-tiny", "--config", f"{base}/secret.json"], "config"),
             (["port", f"{base}/secret.json"], "config"),  # parity.inputs names it so itself
             (["port", f"{base}/ds.json", "--quiet", "-o", f"{base}/ro/o.yaml"], "--output"),
             (["estimate", "--preset", "gpt2-tiny", "--json", f"{base}/ro/e.json"], "--json"),
             (["convert-weights", f"{base}/w.safetensors", f"{base}/ro/o.safetensors"], "DST"),
             (["compare", "--preset", "gpt2-tiny", "--out", f"{base}/ro/run"], "--out"),
             (["report", f"{base}/locked"], "RUN_DIR"), (["check", f"{base}/locked", f"{base}/ro"], "NEW")]
    results = _unprivileged([argv for argv, _ in cases])
  finally:
    for dirpath, dirs, files in os.walk(base):
      for n in dirs + files:
        os.chmod(os.path.join(dirpath, n), 0o755)
    shutil.rmtree(base)
  for (argv, flag), (rc, err) in zip(cases, results):
    assert rc == 2 and f"error: {flag} " in err and "internal error" not in err, (argv, err)
    assert "ermission denied" in err or "not a parity run folder" in err or "no such" in err, (argv, err)
