"""Strict validation of Kubernetes objects against the official schemas, for the tests (no
apiserver can run here: ../shared/KUBERNETES.md).

Built-in kinds: kubernetes-validate's strict schemas of the Kubernetes versions named in
VERSIONS. JobSet: kubeflow-trainer-api's pydantic models as a JSON schema with
``additionalProperties: false`` on every object (the models themselves drop unknown fields), each
replicated job's template checked again as a strict batch/v1 Job, its metadata as ObjectMeta.
Then what the schemas cannot say: DNS-1123 names, an extended resource's request equal to its
limit, restartPolicy Never/OnFailure in Jobs, an image in every container, completions on
Indexed Jobs."""

from __future__ import annotations

import functools
import re
from typing import Any

import jsonschema
import kubernetes_validate

from frenzy_prefect.launch.kubernetes_manifest import JOBSET_API, containers_of, gpu_request_problems

VERSIONS = ("1.29.0", "1.32.0")  # the Kubernetes versions the launcher is held to
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class Invalid(Exception):
    """What the apiserver would answer 422 Invalid for: the field's path and why."""

    def __init__(self, causes: list[tuple[str, str]]):
        self.causes = causes
        super().__init__("; ".join(f"{field}: {why}" for field, why in causes))


def _strict(schema: Any) -> Any:
    """``schema`` with every object closed (additionalProperties: false)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if out.get("type") == "object" or "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _unwrapped_one_of(definition: dict[str, Any]) -> dict[str, Any]:
    """openapi-generator models a oneOf (Quantity, IntOrString) as an object with its
    ``actual_instance``: in JSON it is the bare value (``8``, ``"64Gi"``), so the schema is the
    union itself."""
    props = definition.get("properties", {})
    if "one_of_schemas" not in props:
        return definition
    return {"anyOf": [s for s in props["actual_instance"]["anyOf"] if s != {"type": "null"}]}


@functools.cache
def jobset_schema() -> dict[str, Any]:
    from kubeflow_trainer_api.models import JobsetV1alpha2JobSet

    schema = JobsetV1alpha2JobSet.model_json_schema(by_alias=True)
    schema["$defs"] = {name: _unwrapped_one_of(d) for name, d in schema.get("$defs", {}).items()}
    return _strict(schema)


def _path(error: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "<object>"


def _leaves(error: jsonschema.ValidationError) -> list[jsonschema.ValidationError]:
    return [leaf for c in error.context for leaf in _leaves(c)] if error.context else [error]


def _official(obj: dict[str, Any], version: str) -> None:
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        raise Invalid([(_path(exc), exc.message)]) from None


def _jobset(obj: dict[str, Any], version: str) -> None:
    errors = [leaf for e in jsonschema.Draft202012Validator(jobset_schema()).iter_errors(obj) for leaf in _leaves(e)]
    if errors:  # (an optional field is anyOf [its schema, null]: the causes are the deepest errors)
        raise Invalid([(_path(e), e.message) for e in sorted(errors, key=lambda e: len(e.absolute_path), reverse=True)[:5]])
    _official({"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj.get("metadata", {})}, version)  # ObjectMeta, strictly
    for i, rj in enumerate(obj.get("spec", {}).get("replicatedJobs", [])):
        template = rj.get("template", {})
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": template.get("metadata", {}), "spec": template.get("spec", {})}
        try:
            _official(job, version)
            _job_rules(job)
        except Invalid as exc:
            raise Invalid([(f"spec.replicatedJobs[{i}].template.{f}", why) for f, why in exc.causes]) from None


def _job_rules(job: dict[str, Any]) -> None:
    spec = job.get("spec", {})
    pod = spec.get("template", {}).get("spec", {})
    causes = []
    if pod.get("restartPolicy") not in ("Never", "OnFailure"):
        causes.append(("spec.template.spec.restartPolicy", f"Unsupported value {pod.get('restartPolicy')!r}: Never or OnFailure"))
    if spec.get("completionMode") == "Indexed" and spec.get("completions") is None:
        causes.append(("spec.completions", "Required value: when completionMode is Indexed"))
    if causes:
        raise Invalid(causes)


def _rules(obj: dict[str, Any]) -> None:
    causes = []
    meta = obj.get("metadata", {})
    name = meta.get("name", "")
    if not (len(name) <= 63 and _DNS_LABEL.match(name)):
        causes.append(("metadata.name", f"Invalid value {name!r}: a DNS-1123 label of at most 63 characters"))
    if "namespace" in meta and not _DNS_LABEL.match(meta["namespace"]):
        causes.append(("metadata.namespace", f"Invalid value {meta['namespace']!r}"))
    causes += [(p.split(":")[0], "Invalid value: must be equal to the limit (extended resource)") for p in gpu_request_problems(obj)]
    for path, container in containers_of(obj):
        if not container.get("image"):
            causes.append((f"{path}.image", "Required value"))
    if obj.get("kind") == "Job":
        try:
            _job_rules(obj)
        except Invalid as exc:
            causes += exc.causes
    if causes:
        raise Invalid(causes)


def validate(obj: dict[str, Any], version: str = VERSIONS[-1]) -> None:
    """Raise Invalid (field, why) where the apiserver of ``version`` (with the JobSet CRD) would refuse ``obj``."""
    if obj.get("apiVersion") == JOBSET_API:
        _jobset(obj, version)
    else:
        _official(obj, version)
    _rules(obj)


def validate_everywhere(obj: dict[str, Any]) -> None:
    for version in VERSIONS:
        validate(obj, version)
