"""The simulator's inputs: the public traces load whole, and a bad row is named by file, line and column."""

import pytest

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.scheduling.inputs import load_alibaba_nodes, load_trace, shared_traces
from frenzy_prefect.spec.catalog import GPU_CATALOG

TRACES = shared_traces()


ELASTICFLOW = TRACES / "elasticflow"


ALIBABA_NODES = TRACES / "alibaba-gpu-v2023" / "openb_node_list_all_node.csv"


HEADER = "job_id,submission_time,num_iteration,model_name,deadline,batch_size,num_gpu,duration\n"


needs_traces = pytest.mark.skipif(not TRACES.exists(), reason="the shared traces are not beside this checkout")


@needs_traces
@pytest.mark.parametrize(("name", "jobs"), [("195job", 195), ("cluster01", 1595), ("cluster04", 15802)])
def test_elasticflow_traces_load_whole_in_submission_order(name, jobs):
    trace = load_trace(ELASTICFLOW / f"{name}.csv")
    assert len(trace) == jobs  # every data row (the files end without a newline)
    assert [j.submission_time for j in trace] == sorted(j.submission_time for j in trace)
    assert {j.model_name for j in trace} <= {"bert", "deepspeech2", "gpt2", "inception3", "resnet50", "vgg16"}


@needs_traces
def test_the_alibaba_cluster_needs_its_undisclosed_types_declared_and_then_has_6212_gpus():
    unknown = (
        "unknown gpu_type 'G[23]'; known types: A10, .* \\(declare it under gpu_types, in the cluster or in a GPU types file "
        "given with it\\)"
    )
    with pytest.raises(FrenzyError, match=unknown):
        load_alibaba_nodes(ALIBABA_NODES)
    declared = {name: GPU_CATALOG["A10"].model_copy(update={"name": name}) for name in ("G2", "G3")}
    cluster = load_alibaba_nodes(ALIBABA_NODES, declared)
    assert sum(n.gpu_count for n in cluster.nodes) == 6212 and len(cluster.nodes) == 1213  # CPU-only nodes left out
    assert {n.gpu_type for n in cluster.nodes} == {"A10", "G2", "G3", "P100", "T4", "V100-16GB", "V100-32GB"}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("a,10,5,gpt2,20,32,one,100\n", ":2: column num_gpu: 'one' is not a number"),
        ("a,10,5,gpt2,20,32,1,100\nb,-3,5,gpt2,20,32,1,100\n", ":3: column submission_time: -3 is negative"),
        ("a,10,5,gpt2,20,32,1.5,100\n", ":2: column num_gpu: 1.5 is not a whole number"),
        ("a,10,5,gpt2,20,32,1,100\na,11,5,gpt2,20,32,1,100\n", ":3: column job_id: 'a' repeats line 2; job ids must be unique"),
        ("a,10,0,gpt2,20,32,1,100\n", ":2: num_iteration: Input should be greater than 0 (got 0)"),
        ("", "holds no jobs"),
    ],
)
def test_a_bad_trace_row_is_named_by_file_line_and_column(tmp_path, body, message):
    path = tmp_path / "trace.csv"
    path.write_text(HEADER + body)
    with pytest.raises(FrenzyError) as exc:
        load_trace(path)
    assert str(exc.value).startswith(str(path)) and message in str(exc.value)


def test_a_trace_without_a_column_names_it(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("job_id,submission_time\na,1\n")
    with pytest.raises(FrenzyError, match=r"trace.csv:1: missing column\(s\) model_name, num_iteration"):
        load_trace(path)
    with pytest.raises(FrenzyError, match="cannot read"):
        load_trace(tmp_path / "absent.csv")
