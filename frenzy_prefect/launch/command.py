"""A command to run on a host: what a launcher starts."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PositiveInt


class Launch(BaseModel):
    model_config = ConfigDict(frozen=True)

    host: str
    node: str | None = Field(default=None, description="The cluster node this runs on, for people reading logs.")
    argv: list[str] = Field(min_length=1, description="An argument list, never a shell string.")
    env: dict[str, str] = Field(default_factory=dict)
    processes: PositiveInt = Field(default=1, description="Processes this command becomes (ranks on the node).")
    port_env: str | None = Field(
        default=None,
        description=(
            "Environment variable that receives the job's rendezvous port: a TCP port the launcher picks free on the host "
            "of the first launch naming it (where the rendezvous listens), the same in every launch naming it."
        ),
    )
