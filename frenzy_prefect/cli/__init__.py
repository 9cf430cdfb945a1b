"""The `frenzy` command line. Subcommands and their --json output are a contract (docs/architecture.md, Contracts).
Commands parse, call the core and print; bad input prints one line on stderr and exits 2, no
traceback (`common.one_line_errors`, run by the top-level group for every command). Importing
this package imports neither torch nor Prefect: commands that need them import them inside."""

from __future__ import annotations

import typer

from frenzy_prefect.cli import check, cluster, memory, plan, recycle, simulate
from frenzy_prefect.cli.common import OneLineErrors

app = typer.Typer(
    cls=OneLineErrors,
    help="Memory-aware LLM training on heterogeneous GPU clusters.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # click's plain help (every sub-command inherits it): rich's panels cut option names to fit 80
    # columns and read `F:B:W` as the emoji code `:B:`.
    rich_markup_mode=None,
)
cluster_app = typer.Typer(help="Cluster inventories (FrenzyCluster blocks).", no_args_is_help=True)
app.add_typer(cluster_app, name="cluster")
recycle_app = typer.Typer(
    help="ReCycle: training through failures by re-routing micro-batches (simulate a trace, plan a failure case).", no_args_is_help=True
)
app.add_typer(recycle_app, name="recycle")

app.command("estimate")(memory.estimate)
app.command("measure")(memory.measure)
app.command("calibrate")(memory.calibrate)
app.command("plan")(plan.plan)
app.command("simulate")(simulate.simulate)
app.command("discover")(cluster.discover)
app.command("presets")(memory.presets)
app.command("deploy")(cluster.deploy)
recycle_app.command("simulate")(recycle.simulate)
cluster_app.command("save")(cluster.cluster_save)
cluster_app.command("use")(cluster.pool_cluster)
cluster_app.command("discover")(cluster.cluster_discover)
cluster_app.command("check")(check.cluster_check)
recycle_app.command("plan")(recycle.plan)

__all__ = ["app"]
