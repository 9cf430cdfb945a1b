"""The `frenzy` command line: the estimate JSON contract, one clear line for bad input, and the
simulator examples of docs/cli.md, run on the traces a clone ships."""

import json
import subprocess
import sys

import pytest

from tests.support.cli import frenzy_process
from tests.support.stack import ROOT


def test_measure_takes_the_same_options_and_prints_the_same_schema():
    options = (
        "gpt-nano",
        "--dp",
        "2",
        "--micro-batch",
        "2",
        "--global-batch",
        "8",
        "--seq-len",
        "64",
        "--zero",
        "1",
        "--precision",
        "fp32",
        "--json",
    )
    measured, estimated = (frenzy_process(command, *options) for command in ("measure", "estimate"))
    assert measured.returncode == 0, measured.stderr
    m, e = json.loads(measured.stdout), json.loads(estimated.stdout)
    assert set(m) == set(e) and [set(r) for r in m["per_rank"]] == [set(r) for r in e["per_rank"]]
    assert [r["rank"] for r in m["per_rank"]] == [0, 1]
    assert m["peak_bytes"] == max(r["peak_bytes"] for r in m["per_rank"])
    assert abs(e["peak_bytes"] - m["peak_bytes"]) <= 0.03 * m["peak_bytes"]


@pytest.mark.mixed
def test_measure_and_estimate_an_uneven_pipeline_within_the_bound_of_even_ones_on_every_rank():
    options = ("gpt-nano", "--pp", "2", "--stage-layers", "3,1", "--micro-batch", "2", "--global-batch", "8", "--seq-len", "64")
    measured, estimated = (frenzy_process(command, *options, "--precision", "fp32", "--json") for command in ("measure", "estimate"))
    assert measured.returncode == 0, measured.stderr
    m, e = json.loads(measured.stdout), json.loads(estimated.stdout)
    assert m["plan"]["stage_layers"] == e["plan"]["stage_layers"] == [3, 1]
    for got, want in zip(m["per_rank"], e["per_rank"], strict=True):
        assert abs(want["peak_bytes"] - got["peak_bytes"]) <= 0.03 * got["peak_bytes"], (got, want)
    assert m["per_rank"][0]["peak_bytes"] > 2 * m["per_rank"][1]["peak_bytes"]  # three layers and the embedding against one


def test_the_command_line_does_not_import_torch():
    """`frenzy --help` or `frenzy plan` must not wait for torch (seconds to import): importing the
    CLI and building its click command pull in neither torch nor deepspeed; `measure` imports them itself."""
    probe = (
        "import sys, typer.main, frenzy_prefect.cli\n"
        "typer.main.get_command(frenzy_prefect.cli.app)\n"
        "print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["deploy", "--approve"], "--approve goes with --on-new-data"),
        (["deploy", "--request", "{request}"], "--on-new-data and --request go together"),
        (["deploy", "--on-new-data", "s3://b/in/", "--request", "{request}"], "global_batch"),
    ],
)
def test_deploy_refuses_bad_arguments_before_importing_prefect(tmp_path, args, message):
    """Prefect's deployment machinery takes seconds to import (15-25 s on a loaded machine):
    `frenzy deploy` checks its arguments, the request file's fields too, before it imports any of Prefect."""
    request = tmp_path / "request.yaml"
    request.write_text("model: gpt-nano\nseq_len: 64\nsteps: 2\n")  # no global_batch
    probe = (
        "import sys\n"
        "from frenzy_prefect.cli import app\n"
        "try:\n"
        f"    app({[a.format(request=request) for a in args]!r})\n"
        "except SystemExit as exit:\n"
        "    print(exit.code, sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] in ('prefect', 'torch')}))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "2 []", out.stdout + out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: ") and message in out.stderr, out.stderr
