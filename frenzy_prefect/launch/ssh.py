"""The SSH launcher: each command runs on its node through ``ssh``, as an argument list.

The ssh command line is fixed (options, the host, and ``PYTHON -m frenzy_prefect.launch.remote``);
the command and its environment go to the remote end over stdin as JSON, so nothing a user
typed is ever parsed by a shell and no secret appears on a command line. Host keys are checked
against the given known_hosts file (BatchMode: never a prompt). Stopping the local ssh client
closes the remote end's stdin, which stops the remote process group.

A job's rendezvous port (Launch.port_env) is picked by the first node's remote end, free on that
node, and reported back over its stdout before the other nodes start: one ssh session per node.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.launch.command import Launch
from frenzy_prefect.launch.local import Account, ProcessGroup, spawn, stop_process_groups
from frenzy_prefect.launch.remote import MESSAGE

SSH_UNREACHABLE = 255  # ssh's own exit code: connection, authentication or host key failure
PORT_TIMEOUT_S = 60.0  # for the first node's remote end to report the rendezvous port (ssh itself gives up connecting after 10 s)
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
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        f"UserKnownHostsFile={settings.known_hosts}",
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "ConnectTimeout=10",
        "-i",
        str(settings.identity_file),
        "-p",
        str(settings.port),
        "-l",
        settings.user,
        "--",
        host,
        shlex.join([settings.python, "-m", "frenzy_prefect.launch.remote"]),
    ]


class RemoteChannel:
    """The messages a remote end sends on its stdout (see remote), read as they come; any other
    line (a login script's output) goes to this process's stderr."""

    def __init__(self, stream: asyncio.StreamReader):
        self.received: dict[str, object] = {}
        self._queue: asyncio.Queue[dict | None] = asyncio.Queue()
        self._ended = False
        self.reader = asyncio.ensure_future(self._read(stream))

    async def _read(self, stream: asyncio.StreamReader) -> None:
        prefix = MESSAGE.encode()
        try:
            while True:
                try:
                    line = await stream.readline()
                except ValueError:  # a line longer than the stream's limit: not a message
                    line = await stream.read(1 << 16)
                if not line:
                    return
                try:
                    message = json.loads(line[len(prefix) :]) if line.startswith(prefix) else None
                except ValueError:
                    message = None
                if isinstance(message, dict):
                    self._queue.put_nowait(message)
                else:
                    sys.stderr.write(line.decode(errors="replace"))
        finally:
            self._queue.put_nowait(None)

    async def get(self, key: str) -> object | None:
        """The value of the first message carrying ``key``; None if the remote end's stdout closed without one."""
        while key not in self.received and not self._ended:
            message = await self._queue.get()
            if message is None:
                self._ended = True
            else:
                self.received.update(message)
        return self.received.get(key)


async def start_ssh(launches: list[Launch], settings: SshSettings, cwd: Path | None = None) -> ProcessGroup:
    processes: list[asyncio.subprocess.Process] = []
    channels: list[RemoteChannel] = []
    port: int | None = None
    try:
        for launch in launches:
            proc = await spawn(ssh_argv(launch.host, settings), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
            processes.append(proc)
            assert proc.stdin is not None and proc.stdout is not None
            channels.append(RemoteChannel(proc.stdout))
            env = {k: v for k, v in launch.env.items() if k not in _HOST_LOCAL}
            spec: dict[str, object] = {"argv": launch.argv, "env": env, "cwd": str(cwd) if cwd else None}
            picks_port = launch.port_env is not None and port is None
            if picks_port:
                spec["port_env"] = launch.port_env  # the first node picks it, free there
            elif launch.port_env is not None:
                env[launch.port_env] = str(port)
            proc.stdin.write(json.dumps(spec).encode() + b"\n")
            await proc.stdin.drain()  # stdin stays open: closing it stops the remote command
            if picks_port:
                try:
                    reported = await asyncio.wait_for(channels[-1].get("port"), PORT_TIMEOUT_S)
                except TimeoutError:
                    raise FrenzyError(
                        f"{launch.node or launch.host} ({launch.host}) did not report a rendezvous port within {PORT_TIMEOUT_S:.0f} s "
                        "(is the node's frenzy-prefect the worker's version?)"
                    ) from None
                if reported is None:  # its remote end ended first (ssh failed, say): its exit code tells why
                    break
                port = int(reported)
    except BaseException:
        await stop_process_groups([p.pid for p in processes])
        raise

    def account(i: int) -> Account:
        async def read() -> dict[str, object]:
            report = await channels[i].get("exit")  # the remote end's last message, just before it exits
            if isinstance(report, dict):
                return report
            # No account: ssh itself failed (255) or the remote end was killed.
            return {"command": "ssh", "pid": processes[i].pid, "exitcode": processes[i].returncode}

        return read

    return ProcessGroup(
        processes,
        launches,
        rendezvous_port=port,
        accounts=[account(i) for i in range(len(processes))],
        readers=[c.reader for c in channels],
    )
