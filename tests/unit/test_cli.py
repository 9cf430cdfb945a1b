"""The `frenzy` command line: the estimate JSON contract, one clear line for bad input, and the
simulator examples of docs/cli.md, run on the traces a clone ships."""

import json
import re
import shlex

import pytest

from frenzy_prefect.units import duration, significant, usd
from tests.support.cli import frenzy, timed_frenzy
from tests.support.stack import EXAMPLE_CLUSTER, ROOT


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


def test_plan_mixed_shows_plans_across_two_types_and_whether_each_beats_the_chosen_one(tmp_path):
    three_types = str(ROOT / "examples" / "clusters" / "three-types-64.yaml")
    args = ["--global-batch", "64", "--seq-len", "1024", "--precision", "fp32", "--cluster", three_types, "--mixed", "--top", "3"]
    data = json.loads(frenzy("plan", "gpt2-xl", *args, "--json").stdout)
    chosen, single, first = data["chosen"], data["plans"][0], data["mixed"][0]
    assert single["gpu_type"] == "A100-80GB" and set(first["plan"]["stage_types"]) == {"A100-80GB", "V100-32GB"}
    assert first["worth_mixing"] and single["step_time_s"] >= 1.1 * first["step_time_s"]
    assert chosen["gpu_type"] == "A100-80GB+V100-32GB" and chosen["plan"] == first["plan"]  # worth it: HAS chooses it
    assert sum(first["plan"]["stage_layers"]) == 48 and len(first["peak_bytes"]) == first["plan"]["pp"]
    # Where one type cannot hold the job at all, the plans across types are the answer, not an error.
    tiny = tmp_path / "a10-t4.yaml"
    tiny.write_text("name: a10-t4\nnetwork_gbps: 12.5\nnodes:\n  - {name: a, host: a, gpu_type: A10, gpu_count: 1}\n"
                    "  - {name: t, host: t, gpu_type: T4, gpu_count: 1}\n")  # fmt: skip
    small = ["--global-batch", "16", "--seq-len", "1024", "--precision", "fp32", "--cluster", str(tiny)]
    out = frenzy("plan", "gpt2-xl", *small, "--mixed")
    assert out.returncode == 0, out.stderr
    assert "across types" in out.stdout and "no plan on one type fits" in " ".join(out.stdout.split())
    # Without --mixed, HAS chooses it, as the train-llm flow would; with a plan pinned it keeps to one type and says why.
    chosen = json.loads(frenzy("plan", "gpt2-xl", *small, "--json").stdout)["chosen"]
    assert chosen["gpu_type"] == "A10+T4" and [p["node"] for p in chosen["placements"]] == ["a", "t"]
    refused = frenzy("plan", "gpt2-xl", *small, "--tp", "1")
    assert refused.returncode != 0 and "across GPU types a plan would fit: dp=1 tp=1 pp=2" in refused.stderr, refused.stderr
    assert "for a run with no plan pinned" in " ".join(refused.stderr.split())


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
        (["estimate", "gpt2-small", "--gpu", "X100"], "unknown GPU type 'X100' (did you mean P100 or H100?); known: H200"),
        (["estimate", "gpt2-small", "--micro-batch", "0"], "micro_batch: Input should be greater than 0 (got 0)"),
        (["estimate", "gpt2-small", "--zero", "4"], "zero: Input should be 0, 1, 2 or 3 (got 4)"),
        (["estimate", "gpt-nano", "--pp", "2", "--stage-layers", "3,2"], "stage_layers (3+2 = 5) must add up to the model's 4 layers"),
        (["estimate", "gpt-nano", "--pp", "2", "--stage-layers", "3;1"], "--stage-layers takes each stage's layers, at least one each"),
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
        (["estimate", "gpt2-smal"], "model 'gpt2-smal' is neither a preset (did you mean gpt2-small?) nor a path"),
        (["estimate", "gpt2-small", "--gpu", "a100"], "unknown GPU type 'a100' (did you mean A100-80GB or A100-40GB?); known: H200"),
    ],
)
def test_bad_input_is_one_line_on_stderr_and_a_nonzero_exit(args, message):
    out = frenzy(*args)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: ") and message in out.stderr


@pytest.mark.parametrize(
    ("optimizer", "message"),
    [
        ("{lr: .inf}", "optimizer.lr: Input should be a finite number (got inf)"),
        ("{betas: [2, -1]}", "optimizer.betas.0: Input should be less than 1 (got 2)"),
        (
            "{warmup_steps: 500}",
            "optimizer.warmup_steps (500) exceeds steps (100): the learning rate would never reach lr; accepted: 0 to 100",
        ),
    ],
)
def test_a_request_files_optimizer_is_checked_before_anything_is_deployed(tmp_path, optimizer, message):
    request = tmp_path / "request.yaml"
    request.write_text(f"model: gpt-nano\nglobal_batch: 8\nseq_len: 64\nsteps: 100\noptimizer: {optimizer}\n")
    out = frenzy("deploy", "--on-new-data", "s3://b/in/", "--request", str(request))
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and message in out.stderr


def test_gpu_types_are_named_ignoring_case_as_in_cluster_files():
    lower, upper = frenzy("estimate", "gpt2-small", "--gpu", "h100", "--json"), frenzy("estimate", "gpt2-small", "--gpu", "H100", "--json")
    assert lower.returncode == 0 and lower.stdout == upper.stdout


def test_no_arguments_still_print_the_help():
    out = frenzy()
    assert out.returncode == 2 and "estimate" in out.stdout and "recycle" in out.stdout


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
    """The peak leads a short first line; the plan, the default sequence length's warning and the
    figure each have a line of their own."""
    out = frenzy("estimate", "llama-micro", "--framework", "megatron", "--tp", "2")
    assert out.returncode == 0, out.stderr
    first, plan, work = out.stdout.splitlines()[:3]
    assert first == "peak 0.049 GiB per GPU (as megatron runs it): llama-micro, 4,287,744 parameters"
    assert (plan, work) == ("  plan dp=1 tp=2 pp=1 mb=1 zero=0 recompute=none", "  bf16, flash attention, seq_len 512")
    assert "  seq_len 512: the model's max_seq_len (--seq-len sets the one you train at)" in out.stdout.splitlines()
    assert "tensor bytes only (no CUDA context, NCCL buffers or allocator fragmentation" in out.stdout
    assert "sequence parallelism on (default with tp > 1)" in out.stdout


# The simulator examples docs/cli.md shows, each with its output: run as a user runs them, from the
# repository root, on the traces in examples/traces/.
JOBS_ON_THREE_TYPES = "--trace examples/traces/elasticflow-cluster01-80jobs.csv --cluster examples/clusters/three-types-64.yaml"


DOCUMENTED_SIMULATIONS = [
    f"frenzy simulate {JOBS_ON_THREE_TYPES} --policy frenzy",
    f"frenzy simulate {JOBS_ON_THREE_TYPES} --policy first-fit",
    "frenzy simulate --trace benchmarks/data/sia/workloads/saturn/workload-1.csv --cluster benchmarks/data/sia/cluster.yaml"
    " --throughput-table benchmarks/data/sia/throughput.csv --policy frenzy",
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
        completed = f"{out['jobs_completed']} / {out['jobs_total']}"
        times = [duration(out[k]) for k in ("avg_jct_s", "p50_jct_s", "p99_jct_s", "makespan_s")]
        return [completed, *times, f"{out['gpu_utilization']:.1%}"]
    events = ", ".join(f"{kind} {n}" for kind, n in out["counts"].items() if kind != "start")
    return [
        f"{out['throughput']:.2f} samples/s, {out['ratio']:.1%} of fault-free",
        f"{out['span_throughput']:.2f} samples/s, {out['span_ratio']:.1%} of fault-free",
        f"{out['fault_free_throughput']:.2f} samples/s",
        events,
        f"{duration(out['downtime_s'])} / {duration(out['stalled_s'])}",
    ]


@pytest.mark.parametrize("command", DOCUMENTED_SIMULATIONS)
def test_the_documented_simulate_examples_run_on_the_shipped_traces(command, monkeypatch):
    monkeypatch.chdir(ROOT)  # the docs' paths are relative to a clone
    shown = _documented_output(command)
    out = frenzy(*shlex.split(command)[1:], "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    stale = [figure for figure in _figures(result) if figure not in shown]
    assert not stale, f"docs/cli.md's output of `{command}` lacks {stale}: run it and paste what it prints"
    if "out_of_memory_restarts" in result:  # a bare count would match anywhere: match its row
        truth = "the throughput table's \\(its rows fit\\)" if "--throughput-table" in command else "published errors, seed 0"
        row = rf"\nout-of-memory restarts +{result['out_of_memory_restarts']}\ntrue peak memory +{truth}\n"
        assert re.search(row, shown), f"docs/cli.md's output of `{command}` shows another out-of-memory count or memory truth"


def test_every_input_file_the_docs_name_ships_with_a_clone():
    """A simulator example in the README or docs/ names files a clone has (FILE-style placeholders aside)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {
        (page.name, path)
        for page in pages
        for path in re.findall(r"--(?:trace|gpu-types|mapping|step-time-table|throughput-table)[ =]([^\s`]+)", page.read_text())
        if not path.isupper()
    }
    assert named, "no simulator example found in the docs"
    missing = sorted((page, path) for page, path in named if not (ROOT / path).is_file())
    assert not missing, f"the docs name files a clone lacks: {missing}"


THREE_TYPES = str(ROOT / "examples" / "clusters" / "three-types-64.yaml")


ANSWER_CPU_S = 10  # the bound `frenzy` promises ("answers within 2 s"), with slack for a slow shared machine


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["estimate", "gpt-nano", "--dp", "1000000000"],
            "dp x tp x pp = 1000000000 x 1 x 1 = 1,000,000,000 GPUs; a plan has at most 65,536",
        ),
        (["estimate", "gpt-nano", "--tp", "2", "--pp", "4", "--dp", "16384"], "= 131,072 GPUs; a plan has at most 65,536 GPUs"),
        (["estimate", "gpt-nano", "--micro-batch", "100000000"], "global_batch: Input should be less than or equal to 16777216"),
        (["estimate", "gpt-nano", "--seq-len", "0"], "seq_len: Input should be greater than 0 (got 0)"),
        (["estimate", "gpt-nano", "--seq-len", "-4"], "seq_len: Input should be greater than 0 (got -4)"),
        (["estimate", "gpt-nano", "--global-batch", "0"], "global_batch: Input should be greater than 0 (got 0)"),
        (
            ["plan", "gpt-nano", "--global-batch", "1000000000000", "--seq-len", "64", "--cluster", str(EXAMPLE_CLUSTER)],
            "global_batch: Input should be less than or equal to 16777216 (got 1000000000000)",
        ),
        (
            ["plan", "gpt-nano", "--global-batch", "100000000", "--seq-len", "64", "--cluster", str(EXAMPLE_CLUSTER)],
            "global_batch: Input should be less than or equal to 16777216 (got 100000000)",
        ),
        (
            ["plan", "gpt2-small", "--global-batch", "8648640", "--seq-len", "64", "--cluster", THREE_TYPES, "--precision", "fp32"],
            "spans 436,512 plans, more than the 10,000 it covers",
        ),
        (
            ["plan", "gpt-nano", "--global-batch", "8", "--seq-len", "0", "--cluster", str(EXAMPLE_CLUSTER)],
            "seq_len: Input should be greater than 0",
        ),
        (
            ["plan", "gpt2-small", "--global-batch", "64", "--seq-len", "256", "--cluster", THREE_TYPES, "--tp", "5"],
            "no plan with tp=5 runs on cluster 'three-types-64': tp=5 does not split gpt2-small's heads (12), kv_heads, hidden and "
            "ffn evenly; accepted on this cluster: [1, 2, 4]",
        ),
        (
            ["plan", "gpt2-small", "--global-batch", "64", "--seq-len", "256", "--cluster", THREE_TYPES, "--pp", "64"],
            "no plan with pp=64 runs on cluster 'three-types-64': pp=64 exceeds gpt2-small's 12 layers; accepted: [1, 2, 4, 8]",
        ),
    ],
)
def test_huge_or_impossible_numbers_are_refused_at_once_naming_the_bound(args, message):
    out, cpu_s = timed_frenzy(*args)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: ") and message in out.stderr, out.stderr
    assert cpu_s < ANSWER_CPU_S


def test_identical_ranks_are_estimated_once_and_printed_once_with_their_count():
    out, cpu_s = timed_frenzy("estimate", "gpt-nano", "--dp", "16384", "--pp", "2", "--global-batch", "32768")
    assert out.returncode == 0, out.stderr
    rows = [line.split()[:2] for line in out.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert rows == [["0-16383", "0"], ["16384-32767", "1"]], out.stdout
    assert cpu_s < ANSWER_CPU_S
    # The JSON keeps its schema (the contract): every rank listed, with its stage.
    out, cpu_s = timed_frenzy("estimate", "gpt-nano", "--dp", "65536", "--zero", "2", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert [r["rank"] for r in data["per_rank"]] == list(range(65536)) and {r["stage"] for r in data["per_rank"]} == {0}
    assert cpu_s < ANSWER_CPU_S


@pytest.mark.parametrize("zero", ["1", "2", "3"])
def test_the_largest_plan_is_estimated_within_the_bound_under_every_zero_stage(zero):
    out, cpu_s = timed_frenzy("estimate", "llama-micro", "--dp", "65536", "--zero", zero)
    assert out.returncode == 0, out.stderr
    assert cpu_s < ANSWER_CPU_S


def test_a_search_within_the_bound_answers_within_it():
    args = ("plan", "gpt2-small", "--global-batch", "4096", "--seq-len", "1024", "--cluster", THREE_TYPES, "--precision", "fp32")
    out, cpu_s = timed_frenzy(*args, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["plans"] and cpu_s < ANSWER_CPU_S


BIG_CLUSTER = """
name: big-hetero
prices: {H100: 2.5, A100-80GB: 1.8}
nodes:
  - {name: h1, host: 127.0.0.1, gpu_type: H100, gpu_count: 8}
  - {name: h2, host: 127.0.0.1, gpu_type: H100, gpu_count: 8}
  - {name: a1, host: 127.0.0.1, gpu_type: A100-80GB, gpu_count: 8}
  - {name: a2, host: 127.0.0.1, gpu_type: A100-80GB, gpu_count: 8}
"""


TIME = r"\d[\d.]* (µs|ms|s|min|h|d)"


COST = r"\$\d[\d,]*(\.\d+)?"


def assert_plain_and_80_wide(text: str) -> None:
    assert text.strip(), "no output"
    for line in text.splitlines():
        assert len(line) <= 80, f"{len(line)} columns: {line!r}"
        assert "…" not in line and "\x1b[" not in line, line
        assert not set(line) & set("┏━┃┡│└─╭╮╰╯"), f"line art in piped output: {line!r}"


@pytest.mark.parametrize(
    ("cluster", "args"),
    [
        ("local-hetero", ["gpt-nano", "--global-batch", "32", "--seq-len", "128", "--precision", "fp32"]),
        ("local-hetero", ["gpt-nano", "--global-batch", "32", "--seq-len", "128", "--steps", "1000000", "--objective", "cost"]),
        ("big", ["gpt3-13b", "--global-batch", "512", "--seq-len", "2048", "--steps", "20000", "--top", "12"]),
    ],
)
@pytest.mark.parametrize("columns", [80, None])
def test_plan_table_fits_80_columns_and_reads_in_units_when_piped(tmp_path, cluster, args, columns):
    """Piped (and at COLUMNS=80): every line fits, no cell is cut to an ellipsis, no box drawing or
    colour codes; each ranked plan is one numbered row whose times and costs carry their units."""
    path = ROOT / "blocks" / f"{cluster}.yaml"
    if cluster == "big":
        path = tmp_path / "big.yaml"
        path.write_text(BIG_CLUSTER)
    out = frenzy("plan", *args, "--cluster", str(path), columns=columns)
    assert out.returncode == 0, out.stderr
    assert_plain_and_80_wide(out.stdout)
    rows = [line.split() for line in out.stdout.splitlines() if re.match(r"\s*\d+\s+\d+ x ", line)]
    ranked = json.loads(frenzy("plan", *args, "--cluster", str(path), "--json").stdout)["plans"]
    assert [int(r[0]) for r in rows] == list(range(1, len(ranked) + 1))
    for row, plan in zip(rows, ranked, strict=True):
        line = " ".join(row)
        p = plan["plan"]
        assert f"{plan['gpus']} x {plan['gpu_type']} dp{p['dp']} tp{p['tp']} pp{p['pp']} mb{p['micro_batch']} z{p['zero']}" in line
        assert line.count(duration(plan["step_time_s"])) >= 1 and re.search(TIME, line), line
        if "--steps" in args:
            assert duration(plan["total_time_s"]) in line
        assert usd(plan["cost"]) in line and re.search(COST + "$", line), line
        assert "e-0" not in line and "e+0" not in line


def test_the_other_tables_fit_80_columns_when_piped():
    out = frenzy("recycle", "plan", "--dp", "8", "--pp", "4", "--microbatches", "16", "--fail", "1,1,3", columns=80)
    assert out.returncode == 0, out.stderr
    assert_plain_and_80_wide(out.stdout)
    assert re.search(rf"iteration {TIME} against {TIME} without failures", out.stdout)
    out = frenzy("presets", columns=80)
    assert_plain_and_80_wide(out.stdout)
    assert re.search(r"^gpt2-xl\s+1\.56 B\s+48\s+1600\s+25\s+50257$", out.stdout, re.M)
    out = frenzy("estimate", "gpt2-small", "--dp", "2", "--tp", "2", "--pp", "2", "--gpu", "A100-80GB", columns=80)
    header, *table = out.stdout.splitlines()  # the header is one sentence, for grep
    assert_plain_and_80_wide("\n".join(table))
    rows = [m.groups() for line in table if (m := re.match(r"\s*(\d+)(?:-(\d+))?\s+[01](?:\s+\d+\.\d{3}){5}$", line))]
    assert sum(int(last or first) - int(first) + 1 for first, last in rows) == 8, out.stdout  # every rank, once


def _commands(group, path=()):
    import click

    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))
        else:
            yield (*path, name), command


def test_every_help_names_every_option_in_full_within_80_columns():
    """No option name cut to an ellipsis, no markup turned into an emoji (`F:B:W`), no line over 80."""
    import typer.main

    from frenzy_prefect.cli import app

    for path, command in _commands(typer.main.get_command(app)):
        out = frenzy(*path, "--help", columns=80)
        assert out.returncode == 0, (path, out.stderr)
        assert_plain_and_80_wide(out.stdout)
        for param in command.params:
            for name in [*param.opts, *param.secondary_opts] if param.param_type_name == "option" else []:
                assert re.search(rf"(^|[\s,/]){re.escape(name)}([\s,=]|$)", out.stdout, re.M), (path, name)
        assert out.stdout.isascii(), (path, out.stdout)  # rich markup once made an emoji of "F:B:W"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0 s"),
        (4.5e-7, "0.45 µs"),
        (0.00241, "2.41 ms"),
        (0.0999, "99.9 ms"),
        (0.16848, "0.168 s"),  # 4.68e-05 hours, as the demo's table used to put it
        (59.9, "59.9 s"),
        (5400, "90 min"),
        (7200, "2 h"),
        (4.8 * 86400, "4.8 d"),
    ],
)
def test_times_read_in_the_unit_a_person_uses(seconds, text):
    assert duration(seconds) == text


@pytest.mark.parametrize(
    ("amount", "text"),
    [(None, "-"), (0, "$0"), (9.459e-05, "$0.0000946"), (0.0999, "$0.10"), (0.5, "$0.50"), (1234.5, "$1,234.50")],
)
def test_costs_read_in_dollars(amount, text):
    assert usd(amount) == text


def test_significant_digits_never_use_an_exponent():
    assert [significant(x) for x in (4.68e-05, 2.5, 1234.4, 0.000999996)] == ["0.0000468", "2.5", "1234", "0.001"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["estimate"], "Missing argument 'model'. (see 'frenzy estimate --help')"),
        (["estimate", "gpt2-small", "--dp", "x"], "Invalid value for '--dp': Input should be a valid integer"),
        (["estimat", "gpt2-small"], "No such command 'estimat'."),
        (["recycle", "replan"], "No such command 'replan'. Did you mean 'plan'? (see 'frenzy recycle --help')"),
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
