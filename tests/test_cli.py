"""The `frenzy` command line: the estimate JSON contract, one clear line for bad input, and the
simulator examples of docs/cli.md, run on the traces a clone ships."""

import json
import re
import shlex
import subprocess
import sys

import pytest

from .conftest import EXAMPLE_CLUSTER, ROOT


def frenzy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "frenzy_prefect.cli", *args], capture_output=True, text=True, timeout=120)


def test_estimate_json_has_the_contracted_schema():
    out = frenzy(
        "estimate",
        "gpt2-small",
        "--dp",
        "2",
        "--tp",
        "2",
        "--pp",
        "2",
        "--micro-batch",
        "2",
        "--global-batch",
        "16",
        "--seq-len",
        "512",
        "--recompute",
        "selective",
        "--precision",
        "bf16",
        "--gpu",
        "A100-80GB",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert [r["rank"] for r in data["per_rank"]] == list(range(8))
    assert [r["stage"] for r in data["per_rank"]] == [0, 0, 0, 0, 1, 1, 1, 1]
    for r in data["per_rank"]:
        assert set(r["breakdown"]) == {"params", "grads", "optimizer", "activations", "other"}
        assert r["peak_bytes"] == sum(r["breakdown"].values())
    assert data["peak_bytes"] == max(r["peak_bytes"] for r in data["per_rank"])


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
    measured, estimated = (frenzy(command, *options) for command in ("measure", "estimate"))
    assert measured.returncode == 0, measured.stderr
    m, e = json.loads(measured.stdout), json.loads(estimated.stdout)
    assert set(m) == set(e) and [set(r) for r in m["per_rank"]] == [set(r) for r in e["per_rank"]]
    assert [r["rank"] for r in m["per_rank"]] == [0, 1]
    assert m["peak_bytes"] == max(r["peak_bytes"] for r in m["per_rank"])
    assert abs(e["peak_bytes"] - m["peak_bytes"]) <= 0.03 * m["peak_bytes"]


def test_estimate_defaults_to_the_models_full_context():
    out = frenzy("estimate", "gpt-nano", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["seq_len"] == 256


def test_plan_json_chooses_a_placement_on_the_example_cluster():
    out = frenzy(
        "plan", "gpt-nano", "--global-batch", "32", "--seq-len", "128", "--cluster", str(EXAMPLE_CLUSTER), "--precision", "fp32", "--json"
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["chosen"]["gpu_type"] == "A10" and data["plans"][0]["gpu_type"] == "A10"
    for plan in [data["chosen"], *data["plans"]]:
        assert plan["margin_bytes"] > 0 and plan["spare_bytes"] >= 0
    first = data["plans"][0]
    assert first["spare_bytes"] == first["gpu_memory_bytes"] - first["margin_bytes"] - first["peak_bytes"]


def test_plan_for_recycle_offers_only_the_pipelines_it_can_keep_running_or_says_what_is_missing():
    common = ["plan", "gpt-nano", "--global-batch", "16", "--seq-len", "64", "--precision", "fp32", "--resilience", "recycle"]
    out = frenzy(*common, "--cluster", str(ROOT / "blocks" / "local-recycle.yaml"), "--json")
    assert out.returncode == 0, out.stderr
    plans = [p["plan"] for p in json.loads(out.stdout)["plans"]]
    assert plans and all(p["dp"] >= 2 and p["pp"] >= 2 and p["tp"] == 1 and p["zero"] == 0 for p in plans)
    out = frenzy(*common, "--cluster", str(EXAMPLE_CLUSTER))  # two GPUs of each type
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "at least 4 GPUs of one type" in out.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["estimate", "gpt2-small", "--tp", "5"],
            "tp (5) must divide heads (12), kv_heads (12), hidden (768) and ffn_hidden (3072); accepted: [1, 2, 3, 4, 6, 12]",
        ),
        (["estimate", "gpt2-small", "--pp", "13"], "pp (13) must not exceed the number of layers (12); accepted: 1..12"),
        (
            ["estimate", "gpt2-small", "--dp", "2", "--micro-batch", "2", "--global-batch", "6"],
            "global_batch (6) must be divisible by dp * micro_batch",
        ),
        (["estimate", "gpt2-small", "--gpu", "X100"], "unknown GPU type 'X100'; known: H200"),
        (["estimate", "gpt2-small", "--micro-batch", "0"], "micro_batch: Input should be greater than 0 (got 0)"),
        (["estimate", "gpt2-small", "--zero", "4"], "zero: Input should be 0, 1, 2 or 3 (got 4)"),
        (
            ["estimate", "gpt2-small", "--zero", "2", "--pp", "2"],
            "zero=2 runs through DeepSpeed, which refuses it with pipelines; use pp=1, or zero 0 or 1 with pp=2",
        ),
        (
            ["measure", "gpt-nano", "--tp", "3"],
            "tp (3) must divide heads (4), kv_heads (4), hidden (128) and ffn_hidden (512); accepted: [1, 2, 4]",
        ),
        (["estimate", "gpt2-small", "--framework", "fsdp", "--dp", "2"], "fsdp models torchtitan's FSDP2: zero=3 with pp=1"),
        (["estimate", "gpt2-small", "--framework", "megatron", "--zero", "3"], "megatron models zero=0 (DDP) and zero=1"),
        (["estimate", "gpt2-small", "--framework", "jax"], "unknown framework 'jax'; supported: frenzy, megatron, fsdp"),
        (
            ["estimate", "gpt2-small", "--vpp", "2"],
            "--sequence-parallel, --vpp and --cross-entropy-fusion apply to --framework megatron only",
        ),
        (["measure", "gpt-nano", "--framework", "megatron"], "measure runs this project's engine: --framework frenzy only"),
        (
            ["estimate", "llama-micro", "--master-weights", "--framework", "megatron"],
            "--master-weights is this engine's choice (--framework frenzy); megatron keeps its own fp32 masters",
        ),
        (
            ["estimate", "llama-micro", "--master-weights", "--precision", "fp32"],
            "master_weights keeps bf16 or fp16 weights beside fp32 masters: set precision bf16 or fp16 (got fp32)",
        ),
        (["measure", "gpt-nano", "--tp", "2", "--precision", "fp16"], "fp16 loss scaling is implemented for plain data parallelism"),
        (["estimate", "gpt2-small", "--precision", "fp8"], "precision: Input should be 'fp32', 'bf16' or 'fp16' (got 'fp8')"),
        (["estimate", "gpt2-small", "--recompute", "some"], "recompute: Input should be 'none', 'selective' or 'full' (got 'some')"),
        (["estimate", "gpt2-small", "--optimizer", "lamb"], "optimizer.name: Input should be 'adamw', 'adam' or 'sgd' (got 'lamb')"),
        (["estimate", "gpt-nano", "--seq-len", "1024"], "seq_len (1024) exceeds the model's max_seq_len (256)"),
        (
            ["plan", "gpt3-13b", "--global-batch", "8", "--seq-len", "2048", "--cluster", str(EXAMPLE_CLUSTER)],
            "the largest GPU available is A10",
        ),
        (["plan", "gpt-nano", "--global-batch", "8", "--seq-len", "64", "--cluster", "nope.yaml"], "cluster file nope.yaml does not exist"),
        (["deploy", "--approve"], "--approve goes with --on-new-data"),
        (["deploy", "--on-new-data", "s3://b/in/"], "--on-new-data and --request go together"),
    ],
)
def test_bad_input_is_one_line_on_stderr_and_a_nonzero_exit(args, message):
    out = frenzy(*args)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: ") and message in out.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["estimate"], "Missing argument 'model'. (see 'python -m frenzy_prefect.cli estimate --help')"),
        (["estimate", "gpt2-small", "--dp", "x"], "Invalid value for '--dp': Input should be a valid integer"),
        (["estimat", "gpt2-small"], "No such command 'estimat'."),
        (["recycle", "replan"], "No such command 'replan'. Did you mean 'plan'? (see 'python -m frenzy_prefect.cli recycle --help')"),
        (
            ["plan", "gpt-nano", "--global-batch", "8", "--seq-len", "64", "--cluster", str(EXAMPLE_CLUSTER), "--top", "0"],
            "Invalid value for '--top'",
        ),
        (
            ["plan", "gpt-nano", "--global-batch", "8", "--seq-len", "64", "--cluster", str(EXAMPLE_CLUSTER), "--top", "-3"],
            "Invalid value for '--top'",
        ),
    ],
)
def test_usage_errors_are_one_line_on_stderr_and_exit_2(args, message):
    """Typer's own errors (a missing argument, a bad integer, an unknown command, a count out of
    range) read like every other error: one line, no usage banner or box."""
    out = frenzy(*args)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: ") and message in out.stderr


def test_no_arguments_still_print_the_help():
    out = frenzy()
    assert out.returncode == 2 and "estimate" in out.stdout and "recycle" in out.stdout


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
    ("framework", "extra"),
    [
        ("frenzy", ["--attention", "flash"]),
        ("frenzy", ["--attention", "eager", "--zero", "1", "--pp", "2"]),
        ("frenzy", ["--attention", "flash", "--zero", "1", "--master-weights"]),
        ("megatron", ["--attention", "flash", "--zero", "1", "--pp", "2"]),
        ("megatron", ["--attention", "eager", "--no-sequence-parallel"]),
        ("fsdp", ["--attention", "flash", "--zero", "3", "--recompute", "selective"]),
        ("fsdp", ["--attention", "eager", "--zero", "3"]),
    ],
)
def test_estimate_json_of_each_framework_keeps_the_schema_and_says_what_it_counts(framework, extra):
    out = frenzy("estimate", "llama-micro", "--dp", "2", "--tp", "2", "--seq-len", "128", "--framework", framework, *extra, "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["framework"] == framework and data["attention"] == extra[1]
    assert data["figure"] == "tensors" and data["includes_gpu_overhead"] is False
    assert data["peak_bytes"] == max(r["peak_bytes"] for r in data["per_rank"])
    for r in data["per_rank"]:
        assert set(r) == {"rank", "stage", "peak_bytes", "breakdown"} and r["peak_bytes"] == sum(r["breakdown"].values())


def test_estimate_with_a_gpu_adds_its_overhead_and_says_so():
    out = frenzy("estimate", "llama-micro", "--seq-len", "128", "--framework", "megatron", "--gpu", "H100", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["includes_gpu_overhead"] is True and data["figure"] == "tensors + GPU overhead (H100)"


def test_estimate_text_states_the_figure_and_the_default_sequence_length():
    out = frenzy("estimate", "llama-micro", "--framework", "megatron", "--tp", "2")
    assert out.returncode == 0, out.stderr
    assert "seq_len 512 (the model's max_seq_len; set --seq-len)" in out.stdout
    assert "tensor bytes only (no CUDA context, NCCL buffers or allocator fragmentation" in out.stdout
    assert "sequence parallelism on (default with tp > 1)" in out.stdout


# The simulator examples docs/cli.md shows, each with its output: run as a user runs them, from the
# repository root, on the traces in examples/traces/.
JOBS_ON_THREE_TYPES = "--trace examples/traces/elasticflow-cluster01-80jobs.csv --cluster examples/clusters/three-types-64.yaml"
DOCUMENTED_SIMULATIONS = [
    f"frenzy simulate {JOBS_ON_THREE_TYPES} --policy frenzy",
    f"frenzy simulate {JOBS_ON_THREE_TYPES} --policy first-fit",
    "frenzy recycle simulate --trace examples/traces/p3-spot-first-2h.csv --dp 4 --pp 4 --microbatches 16 --policy recycle",
    "frenzy recycle simulate --trace examples/traces/p3-spot-first-2h.csv --dp 4 --pp 4 --microbatches 16 --policy checkpoint_restart",
]


def _documented_output(command: str) -> str:
    """The fenced block of docs/cli.md that starts with `$ COMMAND`: the command and its output."""
    for block in re.findall(r"```\n(.*?)```", (ROOT / "docs" / "cli.md").read_text(), re.S):
        if block.startswith(f"$ {command}\n"):
            return block
    pytest.fail(f"docs/cli.md shows no `$ {command}` example")


def _figures(out: dict) -> list[str]:
    """The figures of a run's JSON as its table prints them."""
    if "jobs_total" in out:

        def hours(key: str) -> str:
            return f"{out[key] / 3600:.2f} h"

        completed = f"{out['jobs_completed']} / {out['jobs_total']}"
        return [completed, hours("avg_jct_s"), hours("p50_jct_s"), hours("p99_jct_s"), hours("makespan_s"), f"{out['gpu_utilization']:.1%}"]
    events = ", ".join(f"{kind} {n}" for kind, n in out["counts"].items() if kind != "start")
    return [
        f"{out['throughput']:.2f} samples/s, {out['ratio']:.1%} of fault-free",
        f"{out['span_throughput']:.2f} samples/s, {out['span_ratio']:.1%} of fault-free",
        f"{out['fault_free_throughput']:.2f} samples/s",
        events,
        f"{out['downtime_s']:.0f} s / {out['stalled_s']:.0f} s",
    ]


@pytest.mark.parametrize("command", DOCUMENTED_SIMULATIONS)
def test_the_documented_simulate_examples_run_on_the_shipped_traces(command):
    shown = _documented_output(command)
    argv = [sys.executable, "-m", "frenzy_prefect.cli", *shlex.split(command)[1:], "--json"]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    stale = [figure for figure in _figures(json.loads(out.stdout)) if figure not in shown]
    assert not stale, f"docs/cli.md's output of `{command}` lacks {stale}: run it and paste what it prints"


def test_every_input_file_the_docs_name_ships_with_a_clone():
    """A simulator example in the README or docs/ names files a clone has (FILE-style placeholders aside)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {
        (page.name, path)
        for page in pages
        for path in re.findall(r"--(?:trace|gpu-types|mapping|step-time-table)[ =]([^\s`]+)", page.read_text())
        if not path.isupper()
    }
    assert named, "no simulator example found in the docs"
    missing = sorted((page, path) for page, path in named if not (ROOT / path).is_file())
    assert not missing, f"the docs name files a clone lacks: {missing}"
