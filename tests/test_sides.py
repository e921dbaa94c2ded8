"""A side is one registration (parity.sides): the four sides' records hold the facts the code used to spread over a
dozen tables, a record is checked when it is made, and a new side registered through one record (the tests' numpy
side, tests/fake_side.py) is picked up by the launcher choice, the worker lookup, the sizing model, the report's
labels, the install and socket checks, and runs through the harness, without a line of the repository naming it.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
from pathlib import Path

import pytest

import fake_side
from parity import installed, sides, sockets
from parity.errors import SpecError
from parity.presets import preset
from parity.sides import SideRecord, register_side, side_record, unregister_side
from parity.spec import RunSpec, to_dict

ROOT = Path(__file__).resolve().parents[1]
BUILT_IN = ("deepspeed", "jax", "torch", "fsdp")
SIDE_NAMES = set(BUILT_IN)


@contextlib.contextmanager
def _registered(record: SideRecord):
  """`record` registered for a block (a variant of the fake's record)."""
  register_side(record)
  try:
    yield record
  finally:
    unregister_side(record.name)


@pytest.fixture
def fake():
  """The fake side registered for one test (fake_side.RECORD), unregistered after it."""
  with fake_side.registered() as record:
    yield record


# ----------------------------------------------------------------------------- the four sides' records


def test_the_four_sides_are_registered_with_their_facts():
  assert sides.side_names() == BUILT_IN
  by = {r.name: r for r in sides.all_sides()}
  assert {n: r.launcher for n, r in by.items()} == {"deepspeed": "torchrun", "jax": "jax.distributed",
                                                    "torch": "torchrun", "fsdp": "torchrun"}
  assert {n: r.plan for n, r in by.items()} == {"deepspeed": "deepspeed", "jax": "jax", "torch": None, "fsdp": "fsdp"}
  assert {n: r.state_layout for n, r in by.items()} == {"deepspeed": None, "jax": ("scan_layers",), "torch": (),
                                                        "fsdp": ()}
  assert [n for n, r in by.items() if r.records_threads] == ["deepspeed", "torch", "fsdp"]
  assert [n for n, r in by.items() if r.opens_chip] == ["jax"]
  assert [n for n, r in by.items() if r.sockets] == ["deepspeed", "fsdp"]
  assert by["deepspeed"].hostfile_launcher == "deepspeed.launcher.runner" and by["jax"].hostfile_launcher is None
  assert {n: r.plan_label for n, r in by.items() if r.plan_text} == {
      "deepspeed": "DeepSpeed plan", "jax": "JAX plan", "fsdp": "FSDP2 plan"}
  for r in by.values():  # every module and function a record names exists
    for module in r.workers.values():
      assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), (r.name, module)
    for ref in filter(None, (r.memory_rows, r.plan_text)):
      assert callable(sides.load_ref(ref)), (r.name, ref)
    # a reference is resolved by its one caller, inside that caller's package: the import table is kept
    assert (r.memory_rows or "parity.sizing.").startswith("parity.sizing.")
    assert (r.plan_text or "parity.report.").startswith("parity.report.")
  with pytest.raises(SpecError, match="unknown side 'nope'; the sides are deepspeed, jax, torch, fsdp"):
    side_record("nope")
  assert sides.find_side("nope") is None


@pytest.mark.parametrize("change, match", [
    ({"framework": "numpy"}, "framework 'numpy'; expected one of jax, torch"),
    ({"workers": {"diagnose": "m"}}, "workers need a 'train' module"),
    ({"workers": {"train": "m", "serve": "m"}}, r"only the jobs train, diagnose, port_verify; got \['serve'"),
    ({"memory_rows": "fake_side.memory_rows"}, "memory_rows 'fake_side.memory_rows' is not 'module:function'"),
    ({"memory_rows": None, "estimated": True}, "estimated=True needs memory_rows"),
    ({"name": "Fake-Side"}, "side name 'Fake-Side': use lower-case letters"),
])
def test_a_record_that_cannot_work_is_refused_when_made(change, match):
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(fake_side.RECORD, **change)


def test_a_side_is_registered_once():
  record = fake_side.RECORD
  try:
    assert register_side(record) is record and register_side(dataclasses.replace(record)) is record  # same facts
    with pytest.raises(ValueError, match="side 'fake' is registered already with other facts"):
      register_side(dataclasses.replace(record, label="another"))
    assert sides.side_names() == BUILT_IN + ("fake",)
  finally:
    assert unregister_side("fake") is record
  assert sides.side_names() == BUILT_IN and unregister_side("fake") is None


def test_the_torch_trainers_implement_the_trainer_protocol():
  """torch_impl.trainer.Trainer, the protocol TorchSide drives: each trainer class has its methods, and its `side`
  is a registered torch side."""
  pytest.importorskip("torch")
  pytest.importorskip("deepspeed")
  from torch_impl.baseline import TorchTrainer
  from torch_impl.engine import DeepSpeedTrainer
  from torch_impl.fsdp import FsdpTrainer
  from torch_impl.trainer import Trainer
  methods = [n for n, v in vars(Trainer).items() if callable(v) and not n.startswith("_")]
  assert set(methods) == {"step", "eval_loss", "poison", "canonical_params", "canonical_moments", "state_bytes",
                          "describe"}
  for cls in (DeepSpeedTrainer, TorchTrainer, FsdpTrainer):
    assert all(callable(getattr(cls, m, None)) for m in methods), cls
    assert side_record(cls.side).framework == "torch", cls


# ----------------------------------------------------------------------------- a new side: one record


def _launched(side: str, tmp_path: Path, monkeypatch) -> list[tuple[list[str], dict]]:
  """What harness.ranks.launch_side starts for `side` with 2 ranks: (argv, env) of each spawn (none is run)."""
  from harness import ranks

  class Started(Exception):
    pass
  spawned = []

  def spawn(argv, **kw):
    spawned.append((list(argv), dict(kw.get("env") or {})))
    raise Started
  monkeypatch.setattr(ranks.lifetime, "spawn", spawn)
  cmd = ["python", "-m", "harness.boot", "worker_module", str(tmp_path / "request.json"), "--side", side]
  launch = {"nproc": 2, "nnodes": 1, "node_rank": 0, "coordinator": "127.0.0.1:29555", "hostfile": None}
  with pytest.raises(Started):
    ranks.launch_side(side, cmd, launch, out=tmp_path, env={}, timeout_s=1, watch=None)
  return spawned


def test_a_new_side_is_picked_up_from_its_one_record(fake, tmp_path, monkeypatch):
  from harness import backend, chip
  from parity.history.bands import records_threads
  from parity.protocol import workers
  from parity.protocol.ranks import COORDINATOR_ENV
  from parity.report.run_record import RunRecord
  from parity.report.setup_table import plan_rows
  from parity.sizing import memory
  run = RunSpec(sides=("jax", "fake")).validate()  # a run may name it
  # the worker lookup: the train worker is its own module; no diagnose worker, so diagnose refuses it by name
  assert workers.worker_module("fake") == "fake_side" and workers.SIDE_WORKERS["fake"] == "fake_side"
  with pytest.raises(ValueError, match="no 'diagnose' worker for side 'fake'"):
    workers.worker_module("fake", "diagnose")
  # the launcher: its framework (torch) starts its ranks through torchrun; the same record in jax starts them itself
  ((argv, _),) = _launched("fake", tmp_path, monkeypatch)
  assert argv[3] == "torch.distributed.run" and argv[-4:] == ["worker_module", str(tmp_path / "request.json"),
                                                              "--side", "fake"]
  with _registered(dataclasses.replace(fake, name="fake_jax", framework="jax")):
    spawned = _launched("fake_jax", tmp_path, monkeypatch)
  assert spawned[0][0][3] == "worker_module" and spawned[0][1][COORDINATOR_ENV] == "127.0.0.1:29555"
  assert backend.frameworks_for(["fake"]) == ("torch",) and not chip.holds_chip("fake", {}, lambda: "a TPU VM")
  # the sizing model: its rows, through its record
  rows = memory.estimate(run, sides=("fake",))
  assert rows == fake_side.memory_rows(run) and memory.totals(rows, "fake")["params"]["host"] > 0
  assert "fake" not in memory.estimate_sides()  # not `estimated`: `parity estimate` keeps its columns
  # the report: its plan row, labelled from its record, for a run that has it and only then
  d = {"plan": {}, "run": to_dict(run), "sides": {"jax": {}, "fake": {}}}
  assert ("NumPy fake plan", fake_side.plan_text(RunRecord.of(d))) in plan_rows(RunRecord.of(d))
  assert "NumPy fake plan" not in dict(plan_rows(RunRecord.of({**d, "sides": {"jax": {}}})))
  # install, sockets, history: what its record says (numpy: the base install; no sockets on one rank; no threads)
  assert installed.missing_module("fake") is None
  assert installed.install_line("fake").endswith("pip install -c constraints.txt -e .")  # the base install (a clone)
  assert sockets.needs_sockets("fake", 1) is None and "torchrun" in sockets.needs_sockets("fake", 2)
  assert not records_threads("fake")


def test_an_unregistered_side_is_refused_by_name():
  with pytest.raises(SpecError, match=r"sides must be a non-empty subset of \['deepspeed', 'fsdp', 'jax', 'torch'\]"):
    RunSpec(sides=("jax", "fake")).validate()
  from parity.protocol import workers
  with pytest.raises(ValueError, match="no 'train' worker for side 'fake'"):
    workers.worker_module("fake")


@pytest.mark.process
def test_the_new_side_runs_through_the_harness(fake, tmp_path):
  """harness.runner.run_side starts the registry's worker of the fake side (its own module, which registers its
  record in the worker process), and the run's measured state is what its memory rows predict."""
  from harness.runner import run_side
  from parity.sizing import memory
  from test_loop import STEPS, make_run
  root = make_run(tmp_path / "r")
  done = run_side(root, "fake", timeout_s=120, env={"PYTHONPATH": str(ROOT / "tests")})
  assert done.status == "ok", done.error
  summary = json.loads((root / "fake" / "summary.json").read_text())
  steps = [json.loads(line) for line in (root / "fake" / "steps.jsonl").read_text().splitlines()]
  assert [s["step"] for s in steps] == list(range(STEPS)) and summary["fake_updates"] == STEPS
  predicted = sum(r.bytes for r in memory.estimate(preset("gpt2-tiny"), sides=("fake",)))  # make_run's model
  assert summary["state_bytes_by_memory_kind"] == {"host": predicted}  # float64 p and v, exactly


# ----------------------------------------------------------------------------- what a new side touches

TABLE_FREE = ("parity", "harness")
"""The framework-free packages: no per-side table may live there but the records (parity/sides.py)."""
MODELS_OF_BUILT_IN_SIDES = {
    "parity/sizing/plans.py": "the plan pairs: each pair's jax, deepspeed and fsdp plan, by section",
    "parity/sizing/resources.py": "the resource floor uses the DeepSpeed and JAX memory models",
    "parity/sizing/memory.py": "estimate's default sides and step_rows' default columns (deepspeed, jax)",
    "parity/sizing/measured.py": "predicted vs measured reads each built-in side's own summary fields",
    "parity/spec.py": "RunSpec's default sides",
}
"""Files of parity/ and harness/ that may list several built-in sides, and why: each is about those sides' own
models or defaults, which a new side need not change."""


def _tables_in(text: str) -> list[int]:
  """Lines of a dict, tuple, list or set literal in `text` holding two or more side names (deepspeed, fsdp, torch,
  jax), other than a list of packages (one also holding jaxlib, flax, numpy, ...) or a table of the two frameworks
  (jax and torch alone: harness.doctor.PROBES)."""
  packages = {"jaxlib", "flax", "optax", "numpy", "parity"}
  lines = []
  for node in ast.walk(ast.parse(text)):
    if isinstance(node, ast.Dict):
      items = [n for n in (*node.keys, *node.values) if isinstance(n, ast.Constant)]
    elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
      items = [e for e in node.elts if isinstance(e, ast.Constant)]
    else:
      continue
    named = {i.value for i in items if isinstance(i.value, str)}
    if len(named & SIDE_NAMES) >= 2 and not named & packages and named & SIDE_NAMES != {"jax", "torch"}:
      lines.append(node.lineno)
  return sorted(lines)


def _side_tables() -> dict[str, list[int]]:
  """file -> `_tables_in` it, over the framework-free packages (TABLE_FREE)."""
  out = {}
  for pkg in TABLE_FREE:
    for path in sorted((ROOT / pkg).rglob("*.py")):
      if lines := _tables_in(path.read_text()):
        out[path.relative_to(ROOT).as_posix()] = lines
  return out


def test_the_table_scan_finds_the_tables_a_side_was_once_added_to():
  """The tables the records replaced (spec.SIDES, control.STATE_LAYOUT_KEYS, installed.EXTRAS) are found; a list of
  packages and the frameworks' table are not tables of sides."""
  assert _tables_in('SIDES = ("jax", "deepspeed", "torch", "fsdp")') == [1]
  assert _tables_in('K = {"jax": ("scan_layers",), "deepspeed": None, "torch": (), "fsdp": ()}') == [1]
  assert _tables_in('E = {"jax": "jax", "torch": "torch", "fsdp": "torch", "deepspeed": "deepspeed"}') == [1]
  assert _tables_in('P = {"jax": "jax_impl.doctor", "torch": "torch_impl.doctor"}\nV = ("torch", "deepspeed", '
                    '"numpy")') == []


def _naming(name: str, module: str) -> list[str]:
  """Files of parity/, harness/, jax_impl/ and torch_impl/ whose code names side `name` (a string constant equal to
  it) or imports `module` (docstrings and comments do not count)."""
  out = []
  for pkg in ("parity", "harness", "jax_impl", "torch_impl"):
    for path in sorted((ROOT / pkg).rglob("*.py")):
      for node in ast.walk(ast.parse(path.read_text())):
        imported = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if (isinstance(node, ast.Constant) and node.value in (name, module)) or module in imported:
          out.append(path.relative_to(ROOT).as_posix())
          break
  return out


def test_a_new_side_touches_its_own_file_and_one_record(fake):
  """Every per-side fact of the framework-free code is in a record: no table of sides is left in parity/ or harness/
  outside the records and the built-in sides' own models; the fake side's record names only its own module; and no
  code of the repository names it. So adding a side touches its own files and one record."""
  tables = _side_tables()
  assert set(tables) == set(MODELS_OF_BUILT_IN_SIDES) | {"parity/sides.py"}, tables  # sides.py: the records
  refs = [*fake.workers.values(), fake.memory_rows, fake.plan_text]
  assert {ref.split(":")[0] for ref in refs} == {"fake_side"}  # its worker, memory rows and plan row: its own file
  assert _naming(fake.name, "fake_side") == []
  assert _naming("fsdp", "torch_impl.fsdp_worker")  # the scan finds a side that is named (the built-in fsdp)
