"""scipy's HiGHS branch and bound in a child process that is killed when its time is up.

HiGHS looks at its clock only between phases; on a loaded machine its root node alone overran a
7 s limit threefold. A planner with a time budget runs the solve here: HiGHS gets its own limit,
and the process is killed when the whole budget is spent (no incumbent comes back then). A plain
``python -m`` child rather than multiprocessing, so that callers' scripts need no main guard.

    python -m frenzy_prefect.recycle.killable_milp < pickled problem > pickled result
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from scipy.optimize import LinearConstraint


def solve(objective, constraints: LinearConstraint, integrality, options: dict, kill_after_s: float) -> dict | None:
    """``{"status", "x", "dual_bound"}`` of ``scipy.optimize.milp`` (bounds 0..inf), or None when
    the child was killed after ``kill_after_s`` or died."""
    problem = pickle.dumps((objective, constraints.A, constraints.lb, constraints.ub, integrality, options))
    # The child imports this very package, wherever the caller found it.
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    child = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        out, _ = child.communicate(problem, timeout=kill_after_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        return None
    return pickle.loads(out) if child.returncode == 0 and out else None


def main() -> None:
    from scipy.optimize import Bounds, LinearConstraint, milp

    objective, a, lb, ub, integrality, options = pickle.loads(sys.stdin.buffer.read())
    result = milp(objective, constraints=LinearConstraint(a, lb, ub), integrality=integrality, bounds=Bounds(0, np.inf), options=options)
    sys.stdout.buffer.write(pickle.dumps({"status": result.status, "x": result.x, "dual_bound": result.get("mip_dual_bound")}))


if __name__ == "__main__":
    main()
