"""The model families of tests/test_families_compare.py in bf16: jax~deepspeed~torch by the noise envelope."""
from __future__ import annotations

import pytest

from conftest import requires_all
from test_families_compare import FAMILIES, check_family


@pytest.mark.process
@pytest.mark.slow
@requires_all
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_passes_three_sides_bf16(family, tmp_path):
  check_family(family, "bf16", tmp_path)
