"""Trace-driven simulation of the cluster scheduler (issue 4): its inputs so far."""
