"""ReCycle's liveness on a real TCPStore: the agent's watcher declares dead a trainer whose heartbeat
stopped, and not one whose heartbeat stood still for a while as a crowded host makes it do."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from frenzy_prefect.training.resilient.liveness import HEARTBEAT_S, STALE_S, Heartbeat, Log, append, watch_job_heartbeats

STALL_S = 2.0  # about twice the longest stall measured on a crowded host (liveness.STALE_S's comment)


def test_the_watcher_declares_a_stopped_heartbeat_dead_and_not_one_that_stood_still_a_while():
    base = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    store = dist.PrefixStore("attempt-0", base)  # the first attempt's keys, as the trainers write them
    stop, done = threading.Event(), threading.Event()
    watcher = threading.Thread(target=watch_job_heartbeats, args=("127.0.0.1", base.port, stop))
    watcher.start()

    def stalling_beat() -> None:  # rank 0: beats, stands still for STALL_S once, beats on
        append(store, "hb", (0, 0))
        beats = 0
        while not done.is_set():
            store.add("hb/0/0", 1)
            beats += 1
            time.sleep(STALL_S if beats == 5 else HEARTBEAT_S)

    stalling = threading.Thread(target=stalling_beat)
    stalling.start()
    stopped = Heartbeat(lambda: dist.PrefixStore("attempt-0", dist.TCPStore("127.0.0.1", base.port, is_master=False)), (1, 0))
    time.sleep(0.5)
    stopped.stopped.set()  # rank 1's beat ends with no "done": a hung or lost trainer
    stopped.thread.join()
    ended = time.monotonic()
    deaths, dead = Log(store, "dead"), []
    try:
        while time.monotonic() - ended < STALE_S + 3.0 and (1, 0) not in dead:
            dead += deaths.new()
            time.sleep(HEARTBEAT_S)
        assert (1, 0) in dead, f"a heartbeat stopped for {time.monotonic() - ended:.1f} s was not declared dead"
        assert time.monotonic() - ended > STALE_S - 1.0, "declared dead before its heartbeat was STALE_S old"
        assert (0, 0) not in dead, f"a heartbeat that stood still {STALL_S} s was declared dead"
    finally:
        done.set()
        stop.set()
        stalling.join()
        watcher.join()
