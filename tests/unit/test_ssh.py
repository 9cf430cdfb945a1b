"""The SSH launcher against a real sshd on 127.0.0.1 (Debian's openssh-server, started here
with its own host key and an authorized key, stopped by PID): a two-node job trains through
it, its rendezvous port is picked by the first node's remote end, stopping the ssh client stops
the remote command, and a host that cannot be reached or
whose key is not trusted fails with ssh's code and the host named; and a flow run whose job
variables pick the ssh launcher trains through the pool's worker and sshd."""

import pytest

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.pool.worker import FrenzyJobConfiguration, _check_pool_policy, _check_ssh_launcher
from frenzy_prefect.spec.plan import ParallelPlan, Placement
from tests.support.training import make_job, unchecked


def test_a_known_hosts_file_that_is_missing_or_not_a_file_is_refused_in_one_line_naming_it(tmp_path):
    ssh = FrenzyJobConfiguration(launcher="ssh", ssh_user="trainer", ssh_key_secret="key", ssh_known_hosts=tmp_path / "known_hosts")
    what_to_set = "set the pool's ssh_known_hosts job variable to a readable file holding the nodes' host keys"
    with pytest.raises(FrenzyError, match=f"^the ssh launcher's known_hosts file {tmp_path}/known_hosts does not exist: {what_to_set}"):
        _check_ssh_launcher(ssh)
    with pytest.raises(FrenzyError, match=f"^the ssh launcher's known_hosts file {tmp_path} is not a readable file: {what_to_set}"):
        _check_ssh_launcher(ssh.model_copy(update={"ssh_known_hosts": tmp_path}))
    with pytest.raises(FrenzyError, match="^the ssh launcher needs the pool's ssh_known_hosts set"):
        _check_ssh_launcher(ssh.model_copy(update={"ssh_known_hosts": None}))
    (tmp_path / "known_hosts").write_text("")
    _check_ssh_launcher(ssh)
    _check_ssh_launcher(FrenzyJobConfiguration(launcher="local"))  # nothing to check


def test_the_pool_limits_gpu_types_and_gpus_per_run():
    placements = [Placement(node="n0", host="127.0.0.1", gpus=[0, 1])]
    job = make_job(unchecked("s3://b/d.txt"), "s3://b/out", ParallelPlan(dp=2, micro_batch=4), placements)
    _check_pool_policy(job, FrenzyJobConfiguration(allowed_gpu_types=["A10", "T4"], max_gpus_per_run=2))
    with pytest.raises(FrenzyError, match="this pool allows GPU types H100; the run was allocated A10"):
        _check_pool_policy(job, FrenzyJobConfiguration(allowed_gpu_types=["H100"]))
    with pytest.raises(FrenzyError, match="at most 1 GPUs per run; the run needs 2"):
        _check_pool_policy(job, FrenzyJobConfiguration(max_gpus_per_run=1))
