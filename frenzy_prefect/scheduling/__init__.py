"""Trace-driven simulation of the cluster scheduler (issue 4): cluster scheduling, not failure replay (that is ``recycle.replay``)."""
