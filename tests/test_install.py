"""Installs that fit a GPU node: ranges in pyproject.toml, the measured versions in
constraints.txt, CI and the README installing with them. Reads files and package metadata only (no pip run: the
install itself is shown in docs/install.md)."""
from __future__ import annotations

import re
import tomllib
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from conftest import ROOT

FRAMEWORKS = ("torch", "jax", "jaxlib", "deepspeed", "flax", "optax", "orbax-checkpoint")


def _project() -> dict:
  return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirements(extra: str | None = None) -> list[Requirement]:
  """The requirements of the base install (extra None) or of `extra`, its self-references (`parity[all]`) expanded
  to the extras they name (not the base)."""
  p = _project()
  out = []
  for r in map(Requirement, p["dependencies"] if extra is None else p["optional-dependencies"][extra]):
    if canonicalize_name(r.name) == "parity":
      out += [x for e in sorted(r.extras) for x in _requirements(e)]
    else:
      out.append(r)
  return out


def _names(reqs: list[Requirement]) -> set[str]:
  return {canonicalize_name(r.name) for r in reqs}


def _pins() -> dict[str, Version]:
  pins = {}
  for line in (ROOT / "constraints.txt").read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if line:
      name, sep, ver = line.partition("==")
      assert sep, f"constraints.txt: {line!r} is not NAME==VERSION"
      pins[canonicalize_name(name)] = Version(ver)
  return pins


def test_frameworks_are_open_ranges_so_a_node_keeps_its_builds():
  """No == and no upper bound on the frameworks: pip keeps any installed release above the lower bound."""
  reqs = {canonicalize_name(r.name): r for r in _requirements("all")}
  for name in FRAMEWORKS:
    r = reqs[canonicalize_name(name)]
    ops = {s.operator for s in r.specifier}
    assert ops == {">="}, f"{name}: {r} must be a lower bound only"
  # the GPU node of docs/install.md: torch 2.11 (CUDA 13), jax/jaxlib 0.11.2
  assert Version("2.11.0") in reqs["torch"].specifier and Version("0.11.2") in reqs["jax"].specifier


def test_every_requirement_is_pinned_and_the_pin_is_in_range():
  pins = _pins()
  for r in _requirements() + [r for e in _project()["optional-dependencies"] for r in _requirements(e)]:
    name = canonicalize_name(r.name)
    assert name in pins, f"constraints.txt lacks {r.name}, a requirement of pyproject.toml"
    assert r.specifier.contains(pins[name], prereleases=True), f"{r.name}=={pins[name]} is outside {r}"


def test_this_environment_is_the_measured_one():
  """The suite runs on the versions constraints.txt records (CI installs with it); a drift names the package."""
  pins = _pins()
  drift = []
  for r in _requirements() + _requirements("dev"):
    name = canonicalize_name(r.name)
    try:
      have = Version(metadata.version(r.name))
    except metadata.PackageNotFoundError:
      continue  # an optional side not installed: its tests skip, saying so
    if Version(have.base_version) != Version(pins[name].base_version):  # torch 2.13.0+cpu is pinned as 2.13.0
      drift.append(f"{r.name} {have} (constraints.txt: {pins[name]})")
  assert not drift, ("installed versions differ from constraints.txt: " + ", ".join(drift) +
                     "; install with `pip install -c constraints.txt -e '.[dev]'`, or record the new versions there")


def test_cuda_extras_bring_the_jax_plugin():
  """Each accelerator extra is jax's own extra (the plugin pinned to the installed jax) plus every side, as
  `pip install -e '.[cuda]'` installed before the frameworks became extras."""
  for extra, want in (("cuda", "cuda13"), ("cuda12", "cuda12"), ("cuda-local", "cuda13-local")):
    (r,) = [r for r in _requirements(extra) if r.extras]
    assert r.name == "jax" and r.extras == {want}, (extra, str(r))
    assert _names(_requirements(extra)) >= _names(_requirements("all")), extra


def test_the_base_install_is_framework_free_and_each_extra_brings_its_own():
  """`pip install parity` installs no framework; `parity[jax]` no torch or deepspeed (a TPU VM, a JAX-only user);
  `parity[deepspeed]` brings torch; `all` is the three; `dev` is `all` plus the test tools."""
  frameworks = {canonicalize_name(n) for n in FRAMEWORKS}
  assert not _names(_requirements()) & frameworks
  assert _names(_requirements("jax")) == {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint"}
  assert _names(_requirements("torch")) == {"torch"}
  assert {"torch", "deepspeed", "py-cpuinfo", "ninja"} <= _names(_requirements("deepspeed"))
  assert not _names(_requirements("deepspeed")) & {"jax", "jaxlib", "flax"}
  assert _names(_requirements("all")) == (_names(_requirements("jax")) | _names(_requirements("torch"))
                                          | _names(_requirements("deepspeed")))
  assert _names(_requirements("dev")) >= _names(_requirements("all")) | {"pytest", "pytest-xdist"}
  # the install lines the refusals print name extras that exist (parity/installed.py, from the side records)
  from parity import sides
  extras = {r.extra for r in sides.all_sides() if r.extra} | {f.extra for f in sides.FRAMEWORKS.values()}
  assert extras <= set(_project()["optional-dependencies"])


@pytest.mark.parametrize("path", ["README.md", ".ci/run"])
def test_ci_and_readme_install_with_the_constraints(path):
  text = (ROOT / path).read_text()
  installs = re.findall(r"pip install[^\n&]*-e '\.\[dev\]'", text)
  assert installs, f"{path} has no `pip install ... -e '.[dev]'`"
  assert all("-c constraints.txt" in cmd for cmd in installs), installs
