"""The Kubernetes launcher: a training run becomes one JobSet (or Indexed Jobs and a headless
Service where the JobSet API is not served), watched by a local process.

``python -m frenzy_prefect.launch.kubernetes`` (started, guarded, by the worker like any launched
command; the submission in SUBMISSION_ENV, the kubeconfig in KUBECONFIG_ENV, never in argv)
creates the run's objects (kubernetes_manifest) and stays with them until they end: it watches
the run's pods (label selector on the run's job label), says each phase change (pod, node,
phase, reason) and forwards every pod's log lines, prefixed with the pod's name, less those rank 0
sent to the run's log itself. It exits 0 once every pod Succeeded. A pod that Failed, was
evicted, deleted from under the run (its node lost) or cannot start (its image cannot be pulled,
its Secret is missing) fails the run: the watcher writes the failure's account (pod, node,
reason, the rank from the pod's termination message) to the launcher's failure file, deletes the
run's objects with foreground propagation (their pods go first) and exits non-zero; with
``max_restarts`` left it submits new objects instead (``<run> r1``, ...), on a like node for one
that is lost (launch.node_restart), which resume from the last complete checkpoint. SIGTERM (the
worker cancelling the run, or dying: orphan_guard) deletes them the same way. So no JobSet
outlives the worker that watches it; where the watcher dies with it, the worker that reclaims
the run deletes them (delete_run_objects, pool.reclaim); no worker adopts one.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from typing import Any

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.launch.command import Launch
from frenzy_prefect.launch.failure import ended, write_report
from frenzy_prefect.launch.kubernetes_client import api_client
from frenzy_prefect.launch.kubernetes_inventory import free_counts, read_cluster
from frenzy_prefect.launch.kubernetes_manifest import JOB_LABEL, JOBSET_API, KubernetesSubmission, manifests, object_name
from frenzy_prefect.launch.node_restart import claimed_for_restart, moved_job, replacements
from frenzy_prefect.launch.watcher import ALREADY_LOGGED, CondensedOutput
from frenzy_prefect.spec.plan import JOB_ENV, TrainingJob

SUBMISSION_ENV = "FRENZY_KUBERNETES_SUBMISSION"
KUBECONFIG_ENV = "FRENZY_KUBECONFIG"  # {"config": kubeconfig dict, "context": name or null}; absent: in-cluster
SUBMITTED = "Submitted Kubernetes "  # the watcher's lines the worker reads (the rest it only logs)
WATCH_S = 30  # one watch request's length; the watch is resumed after it
LOG_DRAIN_S = 5.0  # for the pods' logs to end once they all succeeded
DELETE_WAIT_S = 20.0  # after the delete, for the pods to go (their ranks get SIGTERM, then SIGKILL after the grace period)
# A container waiting for one of these will not start by itself: the run fails rather than wait.
NEVER_STARTS = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError", "CreateContainerError"}


def resolve_api(sub: KubernetesSubmission, served: bool) -> KubernetesSubmission:
    """The submission with ``api`` jobset where JobSet is served and wanted, job otherwise."""
    api = "jobset" if served and sub.settings.api != "job" else "job"
    return sub.model_copy(update={"settings": sub.settings.model_copy(update={"api": api})})


def pod_problem(pod: dict[str, Any]) -> str | None:
    """Why the pod failed or will never run, in words, or None while it may still succeed."""
    status = pod.get("status", {}) or {}
    containers = status.get("containerStatuses", []) or []
    for c in containers:
        waiting = (c.get("state", {}) or {}).get("waiting") or {}
        if waiting.get("reason") in NEVER_STARTS:
            return f"cannot start ({waiting['reason']}: {' '.join(str(waiting.get('message', '')).split())})".replace(": )", ")")
    if status.get("phase") != "Failed":
        return None
    if status.get("reason"):  # Evicted, NodeLost, DeadlineExceeded, ...
        return f"failed ({status['reason']}: {' '.join(str(status.get('message', '')).split())})".replace(": )", ")")
    for c in containers:
        term = (c.get("state", {}) or {}).get("terminated") or {}
        if term:
            code = int(term.get("exitCode", 1))
            how = ended(-(code - 128)) if code > 128 and not term.get("reason") == "OOMKilled" else f"exit code {code}"
            return f"failed ({term.get('reason') or 'Error'}, {how})"
    return "failed"


def rank_of(pod: dict[str, Any]) -> dict[str, Any]:
    """The rank account the pod's termination message holds (launch.kubernetes_pod), or {}."""
    for c in (pod.get("status", {}) or {}).get("containerStatuses", []) or []:
        message = ((c.get("state", {}) or {}).get("terminated") or {}).get("message") or ""
        try:
            report = json.loads(message)
        except ValueError:
            continue
        if isinstance(report, dict) and isinstance(report.get("rank"), int):
            return report
    return {}


def failure_report(pod: dict[str, Any], why: str) -> dict[str, object]:
    """The account for the launcher's failure file: ``pod P (rank R) on NODE failed (OOMKilled, exit code 137)``."""
    name, node = pod["metadata"]["name"], (pod.get("spec", {}) or {}).get("nodeName") or "no node"
    rank = rank_of(pod)
    who = f"pod {name}" + (f" (rank {rank['rank']}, pid {rank.get('pid', '?')} {ended(int(rank['exitcode']))})" if rank else "")
    return {"command": who, "node": node, "ended": why, **({"rank": rank["rank"]} if rank else {})}


# The watcher's line for a pod's phase change, which the worker also reads (its pod events).
PHASE_LINE = re.compile(r"^Pod (?P<pod>\S+) on (?P<node>\S+): (?P<phase>[A-Za-z]+)(?: \((?P<reason>[^)]*)\))?$")


def phase_line(pod: dict[str, Any]) -> str:
    status = pod.get("status", {}) or {}
    node = (pod.get("spec", {}) or {}).get("nodeName") or "unscheduled"
    reason = status.get("reason") or next(
        (
            s.get("reason")
            for c in status.get("containerStatuses", []) or []
            for s in ((c.get("state", {}) or {}).get("waiting"), (c.get("state", {}) or {}).get("terminated"))
            if s and s.get("reason")
        ),
        None,
    )
    return f"Pod {pod['metadata']['name']} on {node}: {status.get('phase', 'Pending')}" + (f" ({reason})" if reason else "")


class Watcher:
    """One run's objects from creation to their end."""

    def __init__(self, sub: KubernetesSubmission, kubeconfig: dict[str, Any] | None, context: str | None) -> None:
        self.sub, self.kubeconfig, self.context = sub, kubeconfig, context
        self.cancelled = asyncio.Event()
        self.objects: list[dict[str, Any]] = []
        self.said: dict[str, str] = {}
        self.logs: dict[str, asyncio.Task] = {}
        self.failed: set[str] = set()  # nodes lost in this run
        self.restarts = 0

    def say(self, line: str) -> None:
        try:
            print(line, flush=True)
        except OSError:  # the worker is gone (its end of the pipe closed): nobody to tell
            pass

    async def run(self) -> int:
        """Submit the run and follow it to its end; after a pod's failure, with restarts left,
        again as new objects (on a replacement for a lost node), until one ends otherwise."""
        async with api_client(self.kubeconfig, self.context) as api:
            self.api = api
            while True:
                try:
                    await self.submit()
                except FrenzyError as exc:
                    self.say(f"error: {exc}")
                    write_report({"command": "the Kubernetes API", "ended": f"refused the run: {exc}", "exitcode": 2})
                    return 2
                try:
                    code, failure = await self.follow()
                finally:
                    for task in self.logs.values():
                        task.cancel()
                    self.logs = {}
                if failure is None or not await self.restarted():
                    if failure is not None:
                        write_report(failure)
                    return code

    async def submit(self) -> None:
        from kubernetes_asyncio import client

        served = await self._jobset_served()
        self.sub = resolve_api(self.sub, served)
        self.objects = manifests(self.sub)
        for obj in self.objects:
            try:
                await self._create(obj)
            except client.ApiException as exc:
                await self.delete()
                raise FrenzyError(f"creating {obj['kind']} {obj['metadata']['name']} failed: {_api_reason(exc)}") from None
        kinds = " and ".join(sorted({o["kind"] for o in self.objects}, reverse=True))
        nodes = ", ".join(f"{n.node} x{n.gpus}" for n in self.sub.nodes)
        self.say(f"{SUBMITTED}{kinds} {self.sub.name} in namespace {self.sub.settings.namespace} on {nodes}")

    async def _jobset_served(self) -> bool:
        """API discovery: whether the cluster serves jobset.x-k8s.io/v1alpha2 (its CRD is installed)."""
        from kubernetes_asyncio import client

        if self.sub.settings.api == "job":
            return False
        try:
            found = await client.CustomObjectsApi(self.api).get_api_resources(*JOBSET_API.split("/"))
        except client.ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return any(r.name == "jobsets" for r in found.resources)

    async def _create(self, obj: dict[str, Any]) -> None:
        from kubernetes_asyncio import client

        ns = self.sub.settings.namespace
        if obj["kind"] == "JobSet":
            group, version = JOBSET_API.split("/")
            await client.CustomObjectsApi(self.api).create_namespaced_custom_object(group, version, ns, "jobsets", obj)
        elif obj["kind"] == "Service":
            await client.CoreV1Api(self.api).create_namespaced_service(ns, obj)
        else:
            await client.BatchV1Api(self.api).create_namespaced_job(ns, obj)

    async def delete(self) -> None:
        """Delete the run's objects, their pods first (foreground propagation); wait for the pods to go."""
        for obj in reversed(self.objects):
            if problem := await delete_object(self.api, self.sub.settings.namespace, obj["kind"], obj["metadata"]["name"]):
                self.say(problem)
        self.say(f"Deleted {self.sub.name}'s {', '.join(o['kind'] for o in self.objects)} (propagation Foreground)")
        await until_pods_gone(self.api, self.sub.settings.namespace, self.sub.name)

    async def follow(self) -> tuple[int, dict[str, object] | None]:
        """Watch the run's pods until all succeed, one fails, or the run is cancelled: (exit
        code, the failure's account if a pod failed). A failed run's objects are deleted."""
        watching = asyncio.ensure_future(self._watch())
        cancel = asyncio.ensure_future(self.cancelled.wait())
        done, _ = await asyncio.wait({watching, cancel}, return_when=asyncio.FIRST_COMPLETED)
        if cancel in done:
            watching.cancel()
            self.say(f"Cancelling: deleting {self.sub.name}")
            await self.delete()
            return 128 + signal.SIGTERM, None
        cancel.cancel()
        outcome = watching.result()
        if outcome is None:
            # (the pods' last lines before the verdict; a log that never ends is not waited for)
            await asyncio.wait(list(self.logs.values()) or [asyncio.sleep(0)], timeout=LOG_DRAIN_S)
            self.say(f"Every pod of {self.sub.name} Succeeded")
            return 0, None
        self.say(f"{outcome['command']} on {outcome['node']} {outcome['ended']}")
        await self.delete()
        return 1, outcome

    async def restarted(self) -> bool:
        """After a pod's failure: True when the run goes on as new objects, resuming from its
        last committed checkpoint, a lost node replaced by a like one (launch.node_restart); a
        restart of ``max_restarts`` spent (torchrun gets the rest inside the new pods)."""
        if self.cancelled.is_set() or self.sub.max_restarts <= 0 or JOB_ENV not in self.sub.env:
            return False
        nodes, pods = await read_cluster(self.api)
        usable = {n.name for n in nodes if n.schedulable}
        lost = [n.node for n in self.sub.nodes if n.node not in usable]
        self.failed |= set(lost)
        free = free_counts(nodes, pods)
        moves = replacements(
            [(n.node, n.gpus) for n in self.sub.nodes],
            lost,
            nodes,
            self.failed,
            kind=lambda n: n.product,
            free=lambda n: free.get(n.name, 0),
        )
        if moves is None:
            self.say(f"node {', '.join(lost)} lost; no other node of its GPU product is Ready with its GPUs: the run cannot restart")
            return False
        job = moved_job(TrainingJob.model_validate_json(self.sub.env[JOB_ENV]), moves)
        self.restarts += 1
        # The new pods as the run's next generation: a lost node's pods may live on, and its node come back.
        env, resumes = await asyncio.to_thread(claimed_for_restart, job, {**self.sub.env, JOB_ENV: job.model_dump_json()})
        self.sub = self.sub.model_copy(
            update={
                "name": object_name(f"{self.sub.flow_run_name or 'run'} r{self.restarts}", self.sub.flow_run_id),
                "nodes": [n.model_copy(update={"node": moves[n.node].name}) if n.node in moves else n for n in self.sub.nodes],
                "max_restarts": self.sub.max_restarts - 1,
                "env": env,
            }
        )
        where = ", ".join(f"{n.node} x{n.gpus}" for n in self.sub.nodes)
        why = f"node {', '.join(lost)} lost" if lost else "a pod failed"
        self.say(f"{why}; restarting from {resumes} as {self.sub.name} on {where} ({self.sub.max_restarts} restart(s) left)")
        return True

    async def _watch(self) -> dict[str, object] | None:
        """None once every pod Succeeded; else the first failure's account."""
        from kubernetes_asyncio import client, watch

        core, ns = client.CoreV1Api(self.api), self.sub.settings.namespace
        pods: dict[str, dict[str, Any]] = {}
        version = None
        while True:
            listed = self.api.sanitize_for_serialization(await core.list_namespaced_pod(ns, label_selector=run_selector(self.sub.name)))
            version = listed.get("metadata", {}).get("resourceVersion")
            events = [("ADDED", p) for p in listed.get("items", [])]
            for kind, pod in events:
                if (outcome := self._on_pod(kind, pod, pods)) is not False:
                    return outcome  # type: ignore[return-value]
            stream = watch.Watch().stream(
                core.list_namespaced_pod, ns, label_selector=run_selector(self.sub.name), resource_version=version, timeout_seconds=WATCH_S
            )
            async with stream as events_stream:
                async for event in events_stream:
                    pod = self.api.sanitize_for_serialization(event["object"])
                    if (outcome := self._on_pod(event["type"], pod, pods)) is not False:
                        return outcome  # type: ignore[return-value]

    def _on_pod(self, kind: str, pod: dict[str, Any], pods: dict[str, dict[str, Any]]) -> dict[str, object] | None | bool:
        """Say what changed; the run's outcome once it has one (None: succeeded), else False."""
        name = pod["metadata"]["name"]
        if kind == "DELETED":
            pods.pop(name, None)
            if (pod.get("status", {}) or {}).get("phase") != "Succeeded":
                conditions = (pod.get("status", {}) or {}).get("conditions", []) or []
                why = next((f"{c['type']}: {c.get('reason', '')}" for c in conditions if c.get("type") == "DisruptionTarget"), "")
                return failure_report(pod, f"was deleted before it ended{f' ({why})' if why else ''} (its node lost?)")
            return False
        pods[name] = pod
        line = phase_line(pod)
        if self.said.get(name) != line:
            self.say(line)
            self.said[name] = line
        if (pod.get("status", {}) or {}).get("phase") in ("Running", "Succeeded", "Failed") and name not in self.logs:
            self.logs[name] = asyncio.ensure_future(self._forward_log(name))
        if why := pod_problem(pod):
            return failure_report(pod, why)
        succeeded = [p for p in pods.values() if (p.get("status", {}) or {}).get("phase") == "Succeeded"]
        return None if len(succeeded) == len(self.sub.nodes) else False

    async def _forward_log(self, pod: str) -> None:
        """The pod's log lines, as they come, prefixed with its name, tracebacks condensed to a
        line naming where the whole output is (CondensedOutput)."""
        from kubernetes_asyncio import client

        core = client.CoreV1Api(self.api)
        namespace = self.sub.settings.namespace
        condensed = CondensedOutput(f"`kubectl logs -n {namespace} {pod}`")
        try:
            response = await core.read_namespaced_pod_log(pod, namespace, follow=True, _preload_content=False)
            async with response:
                async for raw in response.content:
                    line = raw.decode(errors="replace").rstrip("\n")
                    if not ALREADY_LOGGED.match(line):
                        for said in condensed.feed(line):
                            self.say(f"[{pod}] {said}")
        except (TimeoutError, client.ApiException, OSError) as exc:
            self.say(f"[{pod}] log not available: {type(exc).__name__}")


def run_selector(name: str) -> str:
    """The label selector of the run ``name``'s objects and pods."""
    return f"{JOB_LABEL}={name}"


async def run_pods(api: Any, namespace: str, name: str) -> list[dict[str, Any]]:
    """The pods of the run ``name`` (its JOB_LABEL), as JSON."""
    from kubernetes_asyncio import client

    found = await client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=run_selector(name))
    return api.sanitize_for_serialization(found).get("items", [])


async def until_pods_gone(api: Any, namespace: str, name: str) -> None:
    """Wait up to DELETE_WAIT_S for the deleted run's pods to go (their ranks get SIGTERM, then SIGKILL after the grace period)."""
    deadline = asyncio.get_running_loop().time() + DELETE_WAIT_S
    while await run_pods(api, namespace, name) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.5)


async def delete_object(api: Any, namespace: str, kind: str, name: str) -> str | None:
    """Delete one of a run's objects (JobSet, Job or Service) with foreground propagation; what
    went wrong in words, or None (gone already counts as deleted)."""
    from kubernetes_asyncio import client

    body = client.V1DeleteOptions(propagation_policy="Foreground")
    try:
        if kind == "JobSet":
            group, version = JOBSET_API.split("/")
            await client.CustomObjectsApi(api).delete_namespaced_custom_object(group, version, namespace, "jobsets", name, body=body)
        elif kind == "Service":
            await client.CoreV1Api(api).delete_namespaced_service(name, namespace, body=body)
        else:
            await client.BatchV1Api(api).delete_namespaced_job(name, namespace, body=body)
    except client.ApiException as exc:
        if exc.status != 404:
            return f"deleting {kind} {name} failed: {_api_reason(exc)}"
    return None


async def delete_run_objects(api: Any, namespace: str, name: str) -> list[str]:
    """Delete whatever of the run ``name`` (its JOB_LABEL) is left in ``namespace``, for a worker
    that reclaims a run whose watcher is gone, and wait for its pods to go: ``Kind/name`` of each
    deleted. Raises FrenzyError where a deletion failed."""
    from kubernetes_asyncio import client

    selector, found = run_selector(name), []
    group, version = JOBSET_API.split("/")
    try:
        jobsets = await client.CustomObjectsApi(api).list_namespaced_custom_object(
            group, version, namespace, "jobsets", label_selector=selector
        )
        found += [("JobSet", js["metadata"]["name"]) for js in jobsets.get("items", [])]
    except client.ApiException as exc:
        if exc.status != 404:  # (404: the cluster serves no JobSet)
            raise FrenzyError(f"listing the JobSets of {name} failed: {_api_reason(exc)}") from None
    jobs = await client.BatchV1Api(api).list_namespaced_job(namespace, label_selector=selector)
    services = await client.CoreV1Api(api).list_namespaced_service(namespace, label_selector=selector)
    # (a JobSet's own Jobs go with it)
    jobs = [j for j in jobs.items if not any(o.kind == "JobSet" for o in j.metadata.owner_references or [])]
    found += [("Job", j.metadata.name) for j in jobs] + [("Service", s.metadata.name) for s in services.items]
    for kind, obj in found:
        if problem := await delete_object(api, namespace, kind, obj):
            raise FrenzyError(problem)
    await until_pods_gone(api, namespace, name)
    return [f"{kind}/{obj}" for kind, obj in found]


def _api_reason(exc: Any) -> str:
    """The Status message of an ApiException, in one line."""
    try:
        return " ".join(str(json.loads(exc.body).get("message", exc.reason)).split())
    except (TypeError, ValueError, AttributeError):
        return f"{exc.status} {exc.reason}"


def main() -> int:
    sub = KubernetesSubmission.model_validate_json(os.environ[SUBMISSION_ENV])
    kube = json.loads(os.environ.get(KUBECONFIG_ENV) or "null")
    watcher = Watcher(sub, kube["config"] if kube else None, kube.get("context") if kube else None)

    async def run() -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, watcher.cancelled.set)
        return await watcher.run()

    return asyncio.run(run())


# The worker's side: the watcher as the run's one launched command.


def kubernetes_launch(sub: KubernetesSubmission, kubeconfig: dict[str, Any] | None, context: str | None, gpus: int) -> Launch:
    env = {**os.environ, SUBMISSION_ENV: sub.model_dump_json()}
    if kubeconfig is not None:
        env[KUBECONFIG_ENV] = json.dumps({"config": kubeconfig, "context": context})
    nodes = ", ".join(n.node for n in sub.nodes)
    return Launch(
        host="127.0.0.1",
        node=f"Kubernetes ({nodes})",
        argv=[sys.executable, "-m", "frenzy_prefect.launch.kubernetes"],
        env=env,
        processes=gpus,
    )


if __name__ == "__main__":
    sys.exit(main())
