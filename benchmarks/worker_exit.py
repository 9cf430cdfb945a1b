"""How a `frenzy` worker goes away, on the embedded stack (a real Prefect server on SQLite, one
`frenzy` pool): what an operator waits for when a worker stops or dies.

- SIGTERM to an idle `prefect worker start` (what a service manager sends): seconds until the
  process has exited, with its server answering and with its server frozen (SIGSTOP: accepts
  connections, never answers), ``--repeats`` times each.
- SIGKILL to a worker: seconds until Prefect shows it OFFLINE. On the worker's own host a dead
  worker's runs are reclaimed at the next heartbeat of any live worker there (its PID is gone);
  from another host a live worker can only tell by that OFFLINE status, so this is how long a
  lost worker's GPUs wait there before the next heartbeat reclaims them (pool/reclaim.py).

    python -m benchmarks.worker_exit [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks import write_result

POOL = "frenzy-exit"


def sigterm_exit_s(stack, name: str, frozen: bool) -> float:
    """Start an idle worker, SIGTERM it (its server frozen or not); seconds until it exited."""
    worker = stack.start_worker(POOL, name=name)
    time.sleep(3)  # past its first poll and heartbeat
    server = stack.processes["prefect-server"]
    if frozen:
        os.killpg(server.pid, signal.SIGSTOP)
    try:
        asked = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=120)
        return time.monotonic() - asked
    finally:
        if frozen:
            os.killpg(server.pid, signal.SIGCONT)


def offline_after_kill_s(stack, name: str, timeout_s: float = 600) -> float:
    """Start a worker, SIGKILL it; seconds until the server shows it OFFLINE."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import WorkerStatus

    worker = stack.start_worker(POOL, name=name)
    time.sleep(3)
    killed = time.monotonic()
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait()
    with stack.client_settings(), get_client(sync_client=True) as client:
        while time.monotonic() < killed + timeout_s:
            status = {w.name: w.status for w in client.read_workers_for_work_pool(POOL)}.get(name)
            if status == WorkerStatus.OFFLINE:
                return time.monotonic() - killed
            time.sleep(1)
    raise RuntimeError(f"{name} still not OFFLINE {timeout_s:.0f} s after SIGKILL")


def prefect_setting(name: str) -> str:
    out = subprocess.run(["prefect", "config", "view", "--show-defaults"], capture_output=True, text=True, check=True).stdout
    return next((line.split("=", 1)[1].split(" ")[0].strip("'") for line in out.splitlines() if line.startswith(name + "=")), "?")


def summary(times: list[float]) -> dict:
    return {"runs": len(times), "median_s": statistics.median(times), "max_s": max(times), "all_s": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/worker_exit.json"))
    args = parser.parse_args()

    from frenzy_prefect.localstack import LocalStack

    with tempfile.TemporaryDirectory() as home, LocalStack(Path(home)) as stack:
        stack.start_prefect()
        load_before = os.getloadavg()
        answering = [sigterm_exit_s(stack, f"term-{k}", frozen=False) for k in range(args.repeats)]
        frozen = [sigterm_exit_s(stack, f"term-frozen-{k}", frozen=True) for k in range(args.repeats)]
        offline = offline_after_kill_s(stack, "killed")
        settings = {
            name: prefect_setting(name)
            for name in (
                "PREFECT_WORKER_HEARTBEAT_SECONDS",
                "PREFECT_SERVER_SERVICES_FOREMAN_LOOP_SECONDS",
                "PREFECT_SERVER_SERVICES_FOREMAN_INACTIVITY_HEARTBEAT_MULTIPLE",
            )
        }
    result = {
        "setup": {"cores": os.cpu_count(), "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "sigterm_idle_server_answering": summary(answering),
        "sigterm_idle_server_frozen": summary(frozen),
        "sigkill_until_offline_s": offline,
        "prefect_settings": settings,
    }
    print(f"{'what':<44}{'median':>10}{'max':>10}")
    rows = (
        ("SIGTERM, idle, server answering", "sigterm_idle_server_answering"),
        ("SIGTERM, idle, server frozen", "sigterm_idle_server_frozen"),
    )
    for label, key in rows:
        print(f"{label:<44}{result[key]['median_s']:>9.1f}s{result[key]['max_s']:>9.1f}s")
    print(f"{'SIGKILL until Prefect shows it OFFLINE':<44}{offline:>9.1f}s")
    print(f"Prefect's settings: {settings}")
    write_result(result, args.json)


if __name__ == "__main__":
    main()
