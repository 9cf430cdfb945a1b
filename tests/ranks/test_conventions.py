"""Prefect's conventions, on real parts (the session's Prefect server and S3 endpoint, real CLI
and worker processes): block registration by module, the pool's default cluster block, deployment
names from the environment, S3 credentials from a prefect-aws block that never show."""

from __future__ import annotations

import subprocess
import sys

from tests.support.stack import ROOT


def test_importing_the_package_imports_neither_prefect_nor_torch_until_a_block_is_asked_for():
    probe = (
        "import sys, frenzy_prefect as f\n"
        "before = sorted(m for m in ('prefect', 'torch') if m in sys.modules)\n"
        "cls = f.FrenzyCluster\n"
        "print(before, cls.__module__, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "frenzy_prefect.blocks", "False"]
