"""The resilient trainer (``resilience: recycle``, ReCycle on live ranks), beside the plain one
(``training/trainer.py``), whose steps it runs through failures (``trainer.py``): each rank's
process supervises its trainer (``supervisor.py``); liveness is kept on the job's store
(``liveness.py``); survivors agree on generations of the process group (``generations.py``); each
step runs the generation's schedule, re-routed around failed workers (``steps.py``); a replacement
rejoins with a live replica's state (``peer_state.py``)."""
