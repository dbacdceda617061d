"""``ferrum-rpc serve`` sets libgomp's spin count before torch loads OpenMP
(``server/cli.py`` says why), and leaves it to the user who chose one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = ("import os, sys\n"
          "if sys.argv[1] == 'torch-first':\n"
          "    import torch\n"
          "from ferrum_rpc.server.cli import openmp_spin\n"
          "print(openmp_spin(), os.environ.get('GOMP_SPINCOUNT'))\n")


@pytest.mark.parametrize("env,order,want", [
    ({}, "cli-first", "50000 50000"),
    ({"GOMP_SPINCOUNT": "50"}, "cli-first", "None 50"),  # the user's count stands
    ({"OMP_WAIT_POLICY": "active"}, "cli-first", "None None"),  # as does a wait policy
    ({}, "torch-first", "None None"),  # OpenMP read its settings already: nothing set
])
def test_serve_sets_the_openmp_spin_count_unless_chosen(env, order, want):
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run([sys.executable, "-c", SCRIPT, order], env={**base, **env}, capture_output=True,
                          text=True, timeout=120, check=True)
    assert done.stdout.split("\n")[-2] == want
