"""The `frenzy` work pool: its worker (``worker.py``), the pool's one queue of runs waiting for GPUs
(``gpu_queue.py``), GPU reservations as leases on the Prefect server (``reservations.py``), runs of
lost workers reclaimed (``reclaim.py``), crashed runs' messages (``crash.py``), the labels that tie a
run to its worker and lease (``run_labels.py``), server calls retried through outages
(``server_calls.py``), and the pool's base job template (``template.py``)."""
