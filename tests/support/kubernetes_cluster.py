"""A scripted Kubernetes cluster for the `kubernetes` tests: the test API server
(tests/support/kubernetes_api.py, real HTTP) with the controllers a training run goes through, each a
short pass of one reconcile loop in the server's own event loop (so every change is an API
object change the launcher sees through its watch):

- the JobSet controller: a Job per replicated job (``<jobset>-<rjob>-<i>``), its pods'
  ``subdomain`` and the headless Service named by it (``network.enableDNSHostnames``);
- the Job controller: an Indexed Job's pods, ``<job>-<index>-<suffix>`` with hostname
  ``<job>-<index>`` and JOB_COMPLETION_INDEX from the completion-index annotation;
- the scheduler: a pending pod to the first Ready, schedulable node that meets its required node
  affinity and pod anti-affinity and has its ``nvidia.com/gpu`` free;
- the kubelet: each bound pod's command as a local process (its own mount namespace, as a
  container has) with only the pod's environment (Secret references and field references
  resolved; a missing Secret is CreateContainerConfigError, an image not on the node
  ErrImagePull), the GPUs the device plugin gave it in NVIDIA_VISIBLE_DEVICES, cluster DNS as the
  pod's /etc/hosts (``<hostname>.<subdomain>`` of every pod a headless Service selects), its
  termination-message file mounted at the container's terminationMessagePath; phase, exit code
  and message reported from the process, its output the pod's log; a deleted pod's process gets
  SIGTERM, then SIGKILL after the grace period, and the pod goes once it has stopped;
- the node lifecycle controller: a node marked lost (``lose_node``) is NotReady, its pods'
  processes die with it and its pods are deleted with a DisruptionTarget condition.

No apiserver, scheduler or kubelet of Kubernetes runs here (../shared/KUBERNETES.md): this is
the contract they keep, as the launcher relies on it. Pods run as root: the mount namespace needs
it (tests skip without it, saying why)."""

from __future__ import annotations

import asyncio
import base64
import copy
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from frenzy_prefect.launch.kubernetes_inventory import node_of, pod_gpus
from frenzy_prefect.launch.kubernetes_manifest import GPU_RESOURCE, HOSTNAME_LABEL, MEMORY_LABEL, PRODUCT_LABEL
from tests.support.kubernetes_api import ApiServer, matches, serve_in_thread

TICK_S = 0.2
DEFAULT_GRACE_S = 30
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
TERMINATION_TARGET = Path("/dev/termination-log")  # the bind mount's target must exist on the host
# The container's entry: its own mount namespace with the pod's /etc/hosts and termination log.
ENTRY = 'mount --bind "$1" /etc/hosts && mount --bind "$2" "$3" && shift 3 && exec "$@"'


def missing() -> str | None:
    """Why pods cannot run here, or None."""
    if os.geteuid() != 0:
        return "the scripted kubelet gives each pod its own mount namespace (its /etc/hosts): run the tests as root"
    if not shutil.which("unshare"):
        return "the scripted kubelet needs unshare (util-linux)"
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare --mount is refused here: {probe.stderr.strip()}"
    return None


def node_object(name: str, gpus: int, product: str | None, memory: int | None = None, ready: bool = True, cordoned: bool = False) -> dict:
    """A Node as the device plugin (allocatable nvidia.com/gpu) and GPU feature discovery (labels) show it."""
    labels = {HOSTNAME_LABEL: name}
    if product:
        labels[PRODUCT_LABEL] = product
    if memory:
        labels[MEMORY_LABEL] = str(memory)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": {"unschedulable": True} if cordoned else {},
        "status": {"allocatable": {"cpu": "64", GPU_RESOURCE: str(gpus)}, "conditions": [{"type": "Ready", "status": str(ready)}]},
    }


def owner(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj["metadata"]
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": meta["name"], "uid": meta["uid"], "controller": True}


def _matches_expression(labels: dict[str, str], e: dict[str, Any]) -> bool:
    value, values = labels.get(e["key"]), e.get("values", [])
    return {
        "In": value in values,
        "NotIn": value not in values,
        "Exists": e["key"] in labels,
        "DoesNotExist": e["key"] not in labels,
    }[e["operator"]]


def finished(pod: dict[str, Any]) -> bool:
    return pod.get("status", {}).get("phase") in ("Succeeded", "Failed")


@dataclass
class Container:
    """A pod's running process and what the kubelet keeps for it."""

    proc: subprocess.Popen
    node: str
    log: Path
    hosts: Path
    hosts_text: str  # what the hosts file holds now
    message: Path
    gpus: list[int]
    stop_at: float | None = None  # when SIGKILL follows the SIGTERM of a deletion
    lost: bool = False  # its node was lost: nothing is reported any more
    oom: bool = False  # killed by the OOM killer


@dataclass
class ScriptedCluster:
    api: ApiServer
    workdir: Path
    images: set[str] | None = None  # None: every image is on every node
    containers: dict[str, Container] = field(default_factory=dict)  # pod name ->
    jobsets_done: set[str] = field(default_factory=set)
    jobs_done: set[str] = field(default_factory=set)
    url: str = ""
    loop: asyncio.AbstractEventLoop | None = None

    def add_node(self, name: str, gpus: int, product: str, memory: int | None = None) -> None:
        self.api.put("nodes", node_object(name, gpus, product, memory), "ADDED")

    def add_secret(self, namespace: str, name: str, data: dict[str, str]) -> None:
        encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
        secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace}, "data": encoded}
        self.api.put("secrets", secret, "ADDED")

    def pods(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return [o for (p, ns, _), o in list(self.api.objects.items()) if p == "pods" and namespace in (None, ns)]

    # The controllers: one pass each per tick.

    async def reconcile_forever(self) -> None:
        while True:
            try:
                self.jobset_controller()
                self.job_controller()
                self.scheduler()
                self.kubelet()
            except Exception as exc:  # a test's cluster must not die silently: the pods' logs say it
                print(f"scripted cluster: {type(exc).__name__}: {exc}", flush=True)
            await asyncio.sleep(TICK_S)

    def jobset_controller(self) -> None:
        for (plural, ns, name), js in list(self.api.objects.items()):
            if plural != "jobsets" or js["metadata"]["uid"] in self.jobsets_done:
                continue
            self.jobsets_done.add(js["metadata"]["uid"])
            network = js["spec"].get("network", {})
            subdomain = network.get("subdomain") or name
            if network.get("enableDNSHostnames"):
                self.api.put("services", self._service(js, subdomain, network.get("publishNotReadyAddresses", False)), "ADDED")
            for rj in js["spec"]["replicatedJobs"]:
                for i in range(rj.get("replicas", 1)):
                    template = copy.deepcopy(rj["template"])
                    labels = {**template.get("metadata", {}).get("labels", {}), JOBSET_NAME: name}
                    pod_template = template["spec"]["template"]
                    pod_template.setdefault("metadata", {})["labels"] = {**pod_template["metadata"].get("labels", {}), JOBSET_NAME: name}
                    if network.get("enableDNSHostnames"):
                        pod_template["spec"]["subdomain"] = subdomain
                    job = {
                        "apiVersion": "batch/v1",
                        "kind": "Job",
                        "metadata": {"name": f"{name}-{rj['name']}-{i}", "namespace": ns, "labels": labels, "ownerReferences": [owner(js)]},
                        "spec": template["spec"],
                    }
                    job["metadata"]["uid"] = secrets.token_hex(8)
                    self.api.put("jobs", job, "ADDED")

    def _service(self, js: dict[str, Any], name: str, not_ready: bool) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": name,
                "namespace": js["metadata"]["namespace"],
                "ownerReferences": [owner(js)],
                "uid": secrets.token_hex(8),
            },
            "spec": {"clusterIP": "None", "selector": {JOBSET_NAME: js["metadata"]["name"]}, "publishNotReadyAddresses": not_ready},
        }

    def job_controller(self) -> None:
        for (plural, _, _), job in list(self.api.objects.items()):
            if plural != "jobs" or job["metadata"]["uid"] in self.jobs_done:
                continue
            self.jobs_done.add(job["metadata"]["uid"])
            assert job["spec"].get("completionMode") == "Indexed", "the scripted Job controller makes Indexed Jobs' pods only"
            for index in range(job["spec"]["completions"]):
                self.api.put("pods", self._pod(job, index), "ADDED")

    def _pod(self, job: dict[str, Any], index: int) -> dict[str, Any]:
        template, name = copy.deepcopy(job["spec"]["template"]), job["metadata"]["name"]
        meta = template.get("metadata", {})
        spec = template["spec"]
        spec["hostname"] = f"{name}-{index}"
        for c in spec["containers"]:
            ref = {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}}
            c["env"] = [*c.get("env", []), {"name": "JOB_COMPLETION_INDEX", "valueFrom": ref}]
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{name}-{index}-{secrets.token_hex(3)[:5]}",
                "namespace": job["metadata"]["namespace"],
                "uid": secrets.token_hex(8),
                "labels": {**meta.get("labels", {}), "job-name": name, COMPLETION_INDEX: str(index)},
                "annotations": {**meta.get("annotations", {}), COMPLETION_INDEX: str(index)},
                "ownerReferences": [owner(job)],
            },
            "spec": spec,
            "status": {"phase": "Pending"},
        }

    def scheduler(self) -> None:
        for pod in self.pods():
            if pod["spec"].get("nodeName") or pod["metadata"].get("deletionTimestamp"):
                continue
            node = next((n for n in self._nodes() if self._fits(pod, n)), None)
            if node is None:
                if not pod["status"].get("conditions"):
                    why = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0 nodes are available"}
                    self.api.put("pods", {**pod, "status": {**pod["status"], "conditions": [why]}})
                continue
            bound = copy.deepcopy(pod)
            bound["spec"]["nodeName"] = node["metadata"]["name"]
            bound["status"]["conditions"] = [{"type": "PodScheduled", "status": "True"}]
            self.api.put("pods", bound)

    def _nodes(self) -> list[dict[str, Any]]:
        nodes = sorted((o for (p, _, _), o in self.api.objects.items() if p == "nodes"), key=lambda n: n["metadata"]["name"])
        return [n for n in nodes if node_of(n).schedulable]

    def _fits(self, pod: dict[str, Any], node: dict[str, Any]) -> bool:
        name, labels = node["metadata"]["name"], node["metadata"]["labels"]
        affinity = pod["spec"].get("affinity", {})
        terms = affinity.get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms")
        if terms and not any(all(_matches_expression(labels, e) for e in t.get("matchExpressions", [])) for t in terms):
            return False
        here = [p for p in self.pods() if p["spec"].get("nodeName") == name and not finished(p)]
        for term in affinity.get("podAntiAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", []):
            if any(matches(p, term["labelSelector"].get("matchLabels", {})) for p in here):
                return False
        return int(node["status"]["allocatable"].get(GPU_RESOURCE, 0)) - sum(map(pod_gpus, here)) >= pod_gpus(pod)

    # The kubelet.

    def kubelet(self) -> None:
        now = asyncio.get_running_loop().time()
        pods = {p["metadata"]["name"]: p for p in self.pods()}
        for name, pod in pods.items():
            if pod["spec"].get("nodeName") and pod["status"]["phase"] == "Pending" and name not in self.containers:
                if not pod["metadata"].get("deletionTimestamp") and not self._waiting(pod):
                    self._start(pod)
        for name, c in list(self.containers.items()):
            pod = pods.get(name)
            code = c.proc.poll()
            if pod is not None and pod["metadata"].get("deletionTimestamp") and c.stop_at is None and code is None:
                c.proc.send_signal(signal.SIGTERM)  # the container's PID 1
                c.stop_at = now + int(pod["spec"].get("terminationGracePeriodSeconds", DEFAULT_GRACE_S))
            if code is None and c.stop_at is not None and now >= c.stop_at:
                kill_tree(c.proc.pid)
            if code is None:
                if pod is not None:
                    self._write_hosts(c, pod)
                continue
            kill_tree(c.proc.pid)  # what the container's cgroup held goes with it
            del self.containers[name]
            if pod is None or c.lost:
                continue
            if pod["metadata"].get("deletionTimestamp"):
                self.api.remove("pods", pod)
            else:
                self.api.put("pods", self._terminated(pod, code, c))

    def _waiting(self, pod: dict[str, Any]) -> bool:
        """Whether the container cannot be created (its image, its Secrets): then says why in its status."""
        (c,) = pod["spec"]["containers"]
        problem = None
        if self.images is not None and c["image"] not in self.images:
            problem = ("ErrImagePull", f'failed to pull image "{c["image"]}": not found')
        else:
            try:
                self._env(pod, c)
            except LookupError as exc:
                problem = ("CreateContainerConfigError", str(exc.args[0]))
        if problem is None:
            return False
        state = {"waiting": {"reason": problem[0], "message": problem[1]}}
        status = {"name": c["name"], "image": c["image"], "imageID": "", "ready": False, "restartCount": 0, "state": state}
        if pod["status"].get("containerStatuses") != [status]:
            self.api.put("pods", {**pod, "status": {**pod["status"], "containerStatuses": [status]}})
        return True

    def _env(self, pod: dict[str, Any], c: dict[str, Any]) -> dict[str, str]:
        """The container's environment: the image's PATH and HOME, its hostname, then the pod's env in order."""
        env = {"PATH": os.environ["PATH"], "HOME": "/root", "HOSTNAME": pod["spec"].get("hostname") or pod["metadata"]["name"]}
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = e["value"]
            elif ref := e.get("valueFrom", {}).get("secretKeyRef"):
                value = self._secret(pod["metadata"]["namespace"], ref)
                if value is not None:
                    env[e["name"]] = value
            elif ref := e.get("valueFrom", {}).get("fieldRef"):
                env[e["name"]] = field_value(pod, ref["fieldPath"])
        return env

    def _secret(self, namespace: str, ref: dict[str, Any]) -> str | None:
        secret = self.api.objects.get(("secrets", namespace, ref["name"]))
        if secret is None or ref["key"] not in secret.get("data", {}):
            if ref.get("optional"):
                return None
            raise LookupError(
                f'secret "{ref["name"]}" not found'
                if secret is None
                else f"couldn't find key {ref['key']} in Secret {namespace}/{ref['name']}"
            )
        return base64.b64decode(secret["data"][ref["key"]]).decode()

    def _start(self, pod: dict[str, Any]) -> None:
        (c,) = pod["spec"]["containers"]
        name = pod["metadata"]["name"]
        home = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.workdir))
        hosts, message, log = home / "hosts", home / "termination-log", home / "log"
        message.touch()
        env = self._env(pod, c)
        gpus = self._device_plugin(pod)
        env["NVIDIA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        target = c.get("terminationMessagePath", str(TERMINATION_TARGET))
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", ENTRY, name, str(hosts), str(message), target]
        argv += [*c.get("command", []), *c.get("args", [])]
        hosts.write_text(hosts_text := self._hosts_text(pod))
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                argv, env=env, cwd=home, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        container = Container(proc, pod["spec"]["nodeName"], log, hosts, hosts_text, message, gpus)
        self.containers[name] = container
        self.api.log_files[name] = (log, lambda: container.proc.poll() is None)
        running = copy.deepcopy(pod)
        running["status"] |= {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "hostIP": "127.0.0.1",
            "containerStatuses": [
                {"name": c["name"], "image": c["image"], "imageID": "", "ready": True, "restartCount": 0, "state": {"running": {}}}
            ],
        }
        self.api.put("pods", running)

    def _device_plugin(self, pod: dict[str, Any]) -> list[int]:
        """The node's GPU indices no other running container holds, as many as the pod asks for."""
        taken = {g for c in self.containers.values() if c.node == pod["spec"]["nodeName"] for g in c.gpus}
        return [i for i in range(64) if i not in taken][: pod_gpus(pod)]

    def _hosts_text(self, pod: dict[str, Any]) -> str:
        """Cluster DNS for the pod, as its /etc/hosts: every name a headless Service gives a pod of its namespace."""
        names = ["127.0.0.1 localhost"]
        for q in self.pods(pod["metadata"]["namespace"]):
            if (fqdn := self._dns_name(q)) is not None:
                names.append(f"127.0.0.1 {fqdn} {fqdn}.{q['metadata']['namespace']}.svc.cluster.local")
        return "\n".join(names) + "\n"

    def _write_hosts(self, c: Container, pod: dict[str, Any]) -> None:
        """The pod's /etc/hosts anew where cluster DNS changed, rewritten in place (the bind mount follows the file's inode)."""
        if (text := self._hosts_text(pod)) != c.hosts_text:
            with open(c.hosts, "r+") as f:
                f.write(text)
                f.truncate()
            c.hosts_text = text

    def _dns_name(self, pod: dict[str, Any]) -> str | None:
        """``<hostname>.<subdomain>`` where a headless Service named by the subdomain selects the pod."""
        spec, ns = pod["spec"], pod["metadata"]["namespace"]
        if not (spec.get("hostname") and spec.get("subdomain")):
            return None
        svc = self.api.objects.get(("services", ns, spec["subdomain"]))
        if svc is None or svc["spec"].get("clusterIP") != "None":
            return None
        ready_or_published = svc["spec"].get("publishNotReadyAddresses") or pod["status"].get("phase") == "Running"
        if not ready_or_published or not matches(pod, svc["spec"].get("selector", {})):
            return None
        return f"{spec['hostname']}.{spec['subdomain']}"

    def _terminated(self, pod: dict[str, Any], code: int, c: Container) -> dict[str, Any]:
        (spec,) = pod["spec"]["containers"]
        message = c.message.read_text()[-4096:]
        if not message and code != 0 and spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            message = "\n".join(c.log.read_text(errors="replace").splitlines()[-80:])[-2048:]
        exit_code = 128 - code if code < 0 else code  # a signal, as a container runtime reports it
        reason = "Completed" if code == 0 else "OOMKilled" if c.oom else "Error"
        term = {"exitCode": exit_code, "reason": reason, **({"message": message} if message else {})}
        done = copy.deepcopy(pod)
        done["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
        done["status"]["containerStatuses"][0] |= {"ready": False, "state": {"terminated": term}}
        return done

    # Faults a test asks for.

    def kill_container(self, pod: str, oom: bool = False) -> None:
        """SIGKILL the pod's container whole (its cgroup); ``oom``: as the kernel's OOM killer
        does at the container's memory limit, so the runtime reports OOMKilled."""
        c = self.containers[pod]
        c.oom = oom
        kill_tree(c.proc.pid)

    def lose_node(self, node: str) -> None:
        """The node is gone: NotReady, its containers dead with it, its pods evicted (deleted with a DisruptionTarget condition)."""
        asyncio.run_coroutine_threadsafe(self._lose_node(node), self.loop).result(30)

    async def _lose_node(self, node: str) -> None:
        await self._set_ready(node, "Unknown")
        for pod in [p for p in self.pods() if p["spec"].get("nodeName") == node and not finished(p)]:
            if c := self.containers.get(pod["metadata"]["name"]):
                c.lost = True
                kill_tree(c.proc.pid)
            evicted = copy.deepcopy(pod)
            target = {
                "type": "DisruptionTarget",
                "status": "True",
                "reason": "DeletionByTaintManager",
                "message": "Taint manager: deleting due to NoExecute taint",
            }
            evicted["status"]["conditions"] = [*evicted["status"].get("conditions", []), target]
            self.api.put("pods", evicted)
            self.api.remove("pods", evicted)

    def restore_node(self, node: str) -> None:
        """The node is back and Ready."""
        asyncio.run_coroutine_threadsafe(self._set_ready(node, "True"), self.loop).result(30)

    async def _set_ready(self, node: str, ready: str) -> None:
        obj = copy.deepcopy(next(o for (p, _, n), o in self.api.objects.items() if p == "nodes" and n == node))
        obj["status"]["conditions"] = [{"type": "Ready", "status": ready, **({"reason": "NodeStatusUnknown"} if ready != "True" else {})}]
        self.api.put("nodes", obj)

    def start(self) -> str:
        """Serve the API and run the controllers in a thread of their own; the API's URL."""
        TERMINATION_TARGET.touch(exist_ok=True)
        self.api.graceful = lambda pod: pod["metadata"]["name"] in self.containers
        self.url, self._stop, self.loop = serve_in_thread(self.api)
        self._reconciler = asyncio.run_coroutine_threadsafe(self.reconcile_forever(), self.loop)
        return self.url

    def stop(self) -> None:
        self._reconciler.cancel()
        for c in list(self.containers.values()):
            kill_tree(c.proc.pid)
        self._stop()


def field_value(pod: dict[str, Any], path: str) -> str:
    """The downward API: ``metadata.name``, ``metadata.annotations['k']``, ``spec.nodeName``, ..."""
    meta = pod["metadata"]
    for prefix, source in (("metadata.annotations", "annotations"), ("metadata.labels", "labels")):
        if path.startswith(prefix + "['"):
            return meta.get(source, {}).get(path[len(prefix) + 2 : -2], "")
    simple = {
        "metadata.name": meta["name"],
        "metadata.namespace": meta["namespace"],
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": pod["spec"].get("nodeName", ""),
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
        "status.podIP": "127.0.0.1",
        "status.hostIP": "127.0.0.1",
    }
    return simple[path]


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it (a container's cgroup, killed whole)."""
    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.Error:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
