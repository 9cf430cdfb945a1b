"""Requests, model specs, cluster files: invalid values fail at the boundary, naming the field."""

import json
import re

import pytest
import torch
from pydantic import ValidationError

from frenzy_prefect.errors import FrenzyError, describe_validation_error
from frenzy_prefect.profiling.model import CONFIGS, PRESETS, from_hf_config, resolve_model
from frenzy_prefect.spec.cluster import ClusterSpec
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.request import TrainingRequest
from frenzy_prefect.training.decoder import Decoder
from tests.support.stack import EXAMPLE_CLUSTER


def _request(**overrides):
    fields = dict(model="gpt-nano", dataset="s3://b/d.txt", global_batch=8, seq_len=64, steps=3) | overrides
    return TrainingRequest(**fields)


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("global_batch", 0, "global_batch: Input should be greater than 0 (got 0)"),
        ("seq_len", -5, "seq_len: Input should be greater than 0 (got -5)"),
        ("precision", "fp8", "precision: Input should be 'fp32', 'bf16' or 'fp16' (got 'fp8')"),
        ("surprise", 1, "surprise: Extra inputs are not permitted (got 1)"),
        ("optimizer", {"lr": float("inf")}, "optimizer.lr: Input should be a finite number (got inf)"),
        ("optimizer", {"grad_clip": "nan"}, "optimizer.grad_clip: Input should be a finite number (got 'nan')"),
        (
            "optimizer",
            {"betas": [2, -1]},
            "optimizer.betas.0: Input should be less than 1 (got 2); "
            "optimizer.betas.1: Input should be greater than or equal to 0 (got -1)",
        ),
        (
            "optimizer",
            {"warmup_steps": 5},
            "TrainingRequest: optimizer.warmup_steps (5) exceeds steps (3): the learning rate would never reach lr; accepted: 0 to 3",
        ),
        ("deadline_hours", float("inf"), "deadline_hours: Input should be a finite number (got inf)"),
    ],
)
def test_bad_request_fields_are_named_with_what_is_accepted(field, value, expected):
    with pytest.raises(ValidationError) as exc:
        _request(**{field: value})
    assert describe_validation_error(exc.value) == expected


BLANK_FIELDS = [
    ("dataset", "", "dataset: is empty; expected the dataset's URI"),
    ("dataset", " \t", "dataset: is empty; expected the dataset's URI"),
    ("model", "", "model: is empty; expected a preset name"),
    ("output", " ", "output: is empty; expected a URI prefix"),
    ("prepare", {"tokenizer": ""}, "prepare.tokenizer: is empty; expected the URI of a tokenizer.json"),
    ("prepare", {"text_field": " "}, "prepare.text_field: is empty; expected the JSONL field or Parquet column"),
    ("prepare", {"eos_token": ""}, "prepare.eos_token: is empty; expected the token put after every document"),
    ("prepare", {"output": ""}, "prepare.output: is empty; expected a URI prefix"),
]


@pytest.mark.parametrize(("field", "value", "expected"), BLANK_FIELDS)
def test_an_empty_or_blank_uri_or_name_is_refused_naming_the_field(field, value, expected):
    # An empty form field arrives as "": as a dataset it named the worker's working directory.
    with pytest.raises(ValidationError) as exc:
        _request(**{field: value})
    assert describe_validation_error(exc.value).startswith(expected), describe_validation_error(exc.value)


@pytest.mark.parametrize(("field", "value", "expected"), BLANK_FIELDS)
def test_train_llms_parameter_form_refuses_an_empty_or_blank_uri_or_name(field, value, expected):
    # The schema Prefect's UI form and the server's parameter check validate against, generated
    # from the flow's signature, checked by Prefect's own validator.
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools import validate

    from frenzy_prefect.flows.training import train_llm

    schema = parameter_schema(train_llm).model_dump_for_openapi()
    fine = dict(model="gpt-nano", dataset="s3://b/d.txt", global_batch=8, seq_len=64, steps=3, output="s3://b/runs/")
    assert validate({"request": fine | {"prepare": {"tokenizer": "s3://b/tokenizer.json"}}}, schema) == []
    errors = validate({"request": fine | {field: value}}, schema)
    assert errors and all(list(e.path)[:2] == ["request", field] for e in errors), [e.message for e in errors]


@pytest.mark.parametrize(("flow_name", "parameter"), [("prepare_dataset_flow", "source"), ("watch_datasets", "prefix")])
def test_the_dataset_flows_refuse_an_empty_or_blank_raw_prefix_in_their_form_and_their_run(flow_name, parameter):
    from prefect.exceptions import ParameterTypeError
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools import validate

    from frenzy_prefect.flows import datasets

    flow = getattr(datasets, flow_name)
    schema = parameter_schema(flow).model_dump_for_openapi()
    assert validate({parameter: "s3://b/raw/"}, schema) == []
    assert validate({parameter: ""}, schema) and validate({parameter: " "}, schema)
    with pytest.raises(ParameterTypeError, match=f"{parameter}: Value error, is empty; expected the URI of raw text"):
        flow.validate_parameters({parameter: " "})


def test_a_long_bad_value_is_shown_cut_short():
    # An invalid JSON document is the error's input, whole: a corrupt checkpoint manifest's
    # megabytes of losses would otherwise fill the line that names it.
    with pytest.raises(ValidationError) as exc:
        _request(precision="x" * 10_000)
    assert describe_validation_error(exc.value) == f"precision: Input should be 'fp32', 'bf16' or 'fp16' (got '{'x' * 76}...)"


def test_optimizer_settings_are_validated_too():
    with pytest.raises(ValidationError) as exc:
        _request(optimizer={"name": "lamb"})
    assert describe_validation_error(exc.value).startswith("optimizer.name: Input should be 'adamw', 'adam' or 'sgd'")


@pytest.mark.parametrize(
    "name", ["gpt-nano", "gpt-micro", "gpt2-small", "gpt2-medium", "llama-nano", "llama-micro", "llama-2-7b", "mistral-7b", "qwen2-0.5b"]
)
def test_spec_parameter_count_is_the_torch_models(name):
    spec = PRESETS[name]
    with torch.device("meta"):
        model = Decoder(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.parameters


def test_llama_3_1_8b_built_on_the_meta_device_has_its_published_parameter_count():
    with torch.device("meta"):
        model = Decoder(PRESETS["llama-3.1-8b"])
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248


def test_gpt2_small_has_its_published_parameter_count():
    assert PRESETS["gpt2-small"].parameters == 124_439_808


def test_hf_configs_of_both_naming_styles_map_onto_the_spec():
    gpt2 = from_hf_config({"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 300, "n_positions": 128, "model_type": "gpt2"})
    generic = from_hf_config(
        {
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "vocab_size": 300,
            "max_position_embeddings": 128,
            "intermediate_size": 200,
            "tie_word_embeddings": False,
            "make_vocab_size_divisible_by": 128,
        }
    )
    assert (gpt2.layers, gpt2.hidden, gpt2.heads, gpt2.ffn_hidden, gpt2.tied_embeddings, gpt2.padded_vocab) == (2, 64, 4, 256, True, 300)
    assert (generic.ffn_hidden, generic.tied_embeddings, generic.padded_vocab) == (200, False, 384)
    with torch.device("meta"):
        assert sum(p.numel() for p in Decoder(generic).parameters()) == generic.parameters


def test_config_json_path_resolves(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"n_layer": 3, "n_embd": 96, "n_head": 3, "vocab_size": 256, "n_positions": 64}))
    assert resolve_model(str(path)).layers == 3


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("gpt-9000", "nor a path to an HF-style config.json; presets: gpt-nano, gpt-nano-bpe"),
        ("gpt2-smal", "model 'gpt2-smal' is neither a preset (did you mean gpt2-small?) nor a path"),
        ("llama", "neither a preset (did you mean llama-nano, llama-micro or llama-2-7b?)"),
        (
            {"hidden_size": "64", "num_attention_heads": 4, "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 9},
            "model config inline config: hidden_size='64' must be a whole number, written as a JSON number (\"hidden_size\": 64)",
        ),
        ({"n_layer": 2, "n_embd": 64.0, "n_head": 4, "vocab_size": 9, "n_positions": 8}, "n_embd=64.0 must be a whole number"),
        (
            {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 9, "n_positions": 8, "attn_pdrop": "0.1"},
            "attn_pdrop='0.1' must be a number, written as a JSON number (\"attn_pdrop\": 0.1)",
        ),
        ({"n_layer": 2, "n_embd": 64, "n_head": 4}, "lacks vocab_size"),
        ({"n_layer": 2, "n_embd": 64, "n_head": 5, "vocab_size": 9, "n_positions": 8}, "hidden (64) must be divisible by heads (5)"),
        ({"n_layer": 0, "n_embd": 64, "n_head": 4, "vocab_size": 9, "n_positions": 8}, "layers: Input should be greater than 0"),
        ("/nonexistent/config.json", "model config /nonexistent/config.json does not exist"),
    ],
)
def test_bad_models_say_what_is_wrong(model, message):
    with pytest.raises(FrenzyError, match=re.escape(message)):
        resolve_model(model)


def test_preset_names_ignore_case():
    assert resolve_model("GPT2-Small") is PRESETS["gpt2-small"] and resolve_model("Llama-3.1-8B") is PRESETS["llama-3.1-8b"]


def test_example_cluster_is_heterogeneous():
    cluster = ClusterSpec.from_file(EXAMPLE_CLUSTER)
    assert len(cluster.nodes) >= 2
    assert len({n.gpu_type for n in cluster.nodes}) >= 2
    assert all(n.host == "127.0.0.1" for n in cluster.nodes)


def test_cluster_files_reject_unknown_types_and_duplicate_nodes(tmp_path):
    bad_type = tmp_path / "a.yaml"
    bad_type.write_text("nodes:\n  - {name: n1, host: h, gpu_type: X9000, gpu_count: 2}\n")
    with pytest.raises(ValidationError, match="unknown gpu_type 'X9000'; known types: .*A10"):
        ClusterSpec.from_file(bad_type)
    dupes = tmp_path / "b.yaml"
    dupes.write_text("nodes:\n  - {name: n1, host: h, gpu_type: T4, gpu_count: 1}\n  - {name: n1, host: h, gpu_type: T4, gpu_count: 1}\n")
    with pytest.raises(ValidationError, match="node names must be unique; repeated: n1"):
        ClusterSpec.from_file(dupes)


def test_cluster_files_name_gpu_types_as_slurm_discovery_does_and_suggest_close_ones(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("prices: {h100: 2.5, a100_80gb: 1.8}\nnodes:\n  - {name: n1, host: h, gpu_type: h100, gpu_count: 8}\n")
    cluster = ClusterSpec.from_file(path)
    assert cluster.nodes[0].gpu_type == "H100" and cluster.prices == {"H100": 2.5, "A100-80GB": 1.8}
    for typo, hint in [("A100", "(did you mean A100-80GB or A100-40GB?)"), ("H1000", "(did you mean H100, P100 or H200?)")]:
        path.write_text(f"nodes:\n  - {{name: n1, host: h, gpu_type: {typo}, gpu_count: 8}}\n")
        with pytest.raises(ValidationError) as exc:
            ClusterSpec.from_file(path)
        assert f"node 'n1' has unknown gpu_type '{typo}' {hint}; known types: A10, " in describe_validation_error(exc.value)
    path.write_text("prices: {A10G: 1.0}\nnodes:\n  - {name: n1, host: h, gpu_type: A10, gpu_count: 8}\n")
    with pytest.raises(ValidationError, match=r"prices name unknown GPU types A10G \(did you mean A10, "):
        ClusterSpec.from_file(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "does not exist"), ("nodes: [unclosed", "is not valid YAML/JSON"), ("- just a list", "must be a mapping with 'nodes'")],
)
def test_unreadable_cluster_files_are_named(tmp_path, content, message):
    path = tmp_path / "cluster.yaml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(FrenzyError, match=f"cluster file {path} {message}"):
        ClusterSpec.from_file(path)


def test_cluster_can_declare_gpu_types_the_catalog_lacks(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "gpu_types:\n  G1: {name: G1, memory_bytes: 34359738368, half_tflops: 100, fp32_tflops: 20, link_gbps: 32}\n"
        "nodes:\n  - {name: n1, host: h, gpu_type: G1, gpu_count: 8}\n"
    )
    cluster = ClusterSpec.from_file(path)
    assert cluster.gpu_of(cluster.nodes[0]).memory_bytes == 32 * 1024**3


def test_model_spec_rejects_bad_shapes():
    with pytest.raises(ValidationError, match="hidden"):
        ModelSpec(name="x", layers=1, hidden=10, heads=3, vocab_size=5, max_seq_len=4)


PUBLISHED_PARAMETERS = {  # the counts their model cards and papers state
    "llama-2-7b": 6_738_415_616,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096,
    "qwen2-0.5b": 494_032_768,
}


@pytest.mark.parametrize(("name", "count"), PUBLISHED_PARAMETERS.items())
def test_llama_family_configs_have_their_published_parameter_counts(name, count):
    assert PRESETS[name].parameters == count


def test_a_llama_family_config_reads_its_block_design():
    spec = resolve_model(str(CONFIGS / "llama-3.1-8b.json"))
    assert (spec.norm, spec.mlp, spec.position, spec.kv_heads, spec.kv_width, spec.tied_embeddings) == (
        "rmsnorm",
        "swiglu",
        "rope",
        8,
        1024,
        False,
    )
    assert not (spec.qkv_bias or spec.out_bias or spec.mlp_bias)
    assert spec.embedding_parameters == 128_256 * 4096  # no position table (was 537 M phantom parameters)
    qwen = PRESETS["qwen2-0.5b"]
    assert (qwen.qkv_bias, qwen.out_bias, qwen.tied_embeddings) == (True, False, True)
    gpt2 = from_hf_config(
        {
            "model_type": "gpt2",
            "n_layer": 2,
            "n_embd": 64,
            "n_head": 4,
            "vocab_size": 300,
            "n_positions": 128,
            "attn_pdrop": 0.1,
            "resid_pdrop": 0.1,
        }
    )
    assert (gpt2.attention_dropout, gpt2.hidden_dropout, gpt2.norm, gpt2.position) == (0.1, 0.1, "layernorm", "learned")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"model_type": "mixtral", "num_local_experts": 8},
            r"uses model_type 'mixtral' \(supported: gpt2, llama, mistral, qwen2\); a mixture of experts \(num_local_experts=8\), "
            r"which frenzy does not model",  # and nothing about its (SiLU) activation or its Llama-style fields
        ),
        ({"hidden_act": "gelu"}, r"the activation 'gelu' \(accepted here: silu\)"),
        ({"head_dim": 256}, r"head_dim=256 other than hidden_size / num_attention_heads \(128\)"),
        ({"model_type": None}, r"Llama-family fields \(rms_norm_eps, rope_theta, num_key_value_heads\) without a Llama-family model_type"),
    ],
)
def test_what_a_config_asks_and_frenzy_does_not_model_is_refused_naming_the_field(change, message):
    config = json.loads((CONFIGS / "mistral-7b.json").read_text()) | change
    with pytest.raises(FrenzyError, match=message):
        from_hf_config({k: v for k, v in config.items() if v is not None}, "config.json")
