"""Pipeline schedules as data: the IR (``schedule``), fault-free builders (``builder``), what actions
cost (``costs``), when they run (``timeline``), how many micro-batches a worker holds
(``in_flight``) and the checks a schedule must pass (``validate``). Torch-free and Prefect-free:
the training engine executes these schedules, ReCycle's planners produce adapted ones."""
