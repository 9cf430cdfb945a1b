"""The SSH launcher: each command runs on its node through ``ssh``, as an argument list.

The ssh command line is fixed (options, the host, and ``PYTHON -m frenzy_prefect.launch.remote``);
the command and its environment go to the remote end over stdin as JSON, so nothing a user
typed is ever parsed by a shell and no secret appears on a command line. Host keys are checked
against the given known_hosts file (BatchMode: never a prompt). Stopping the local ssh client
closes the remote end's stdin, which stops the remote process group.
"""

from __future__ import annotations

import asyncio
import json
import shlex
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from frenzy_prefect.launch.command import Launch
from frenzy_prefect.launch.local import ProcessGroup, spawn, stop_process_groups

SSH_UNREACHABLE = 255  # ssh's own exit code: connection, authentication or host key failure
# Per-host variables of the worker's own shell that mean nothing on another host.
_HOST_LOCAL = {"HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "SSH_AUTH_SOCK", "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY", "TERM"}


class SshSettings(BaseModel):
    model_config = ConfigDict(frozen=True)

    user: str = Field(min_length=1)
    port: PositiveInt = 22
    identity_file: Path = Field(description="Private key file (mode 0600).")
    known_hosts: Path = Field(description="known_hosts file the nodes' host keys are checked against.")
    python: str = Field(description="The Python interpreter with frenzy-prefect installed, on the nodes.")


def ssh_argv(host: str, settings: SshSettings) -> list[str]:
    return [
        "ssh",
        "-o", "BatchMode=yes",
        "-o", "StrictHostKeyChecking=yes",
        "-o", f"UserKnownHostsFile={settings.known_hosts}",
        "-o", "IdentitiesOnly=yes",
        "-o", "ConnectTimeout=10",
        "-i", str(settings.identity_file),
        "-p", str(settings.port),
        "-l", settings.user,
        "--", host,
        shlex.join([settings.python, "-m", "frenzy_prefect.launch.remote"]),
    ]  # fmt: skip


async def start_ssh(launches: list[Launch], settings: SshSettings, cwd: Path | None = None) -> ProcessGroup:
    processes: list[asyncio.subprocess.Process] = []
    try:
        for launch in launches:
            proc = await spawn(ssh_argv(launch.host, settings), stdin=asyncio.subprocess.PIPE)
            env = {k: v for k, v in launch.env.items() if k not in _HOST_LOCAL}
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({"argv": launch.argv, "env": env, "cwd": str(cwd) if cwd else None}).encode() + b"\n")
            await proc.stdin.drain()  # stdin stays open: closing it stops the remote command
            processes.append(proc)
    except BaseException:
        await stop_process_groups([p.pid for p in processes], grace_s=5)
        raise
    return ProcessGroup(processes, hosts=[l.host for l in launches])
