"""Start a job's processes on its nodes and supervise them as one group."""
