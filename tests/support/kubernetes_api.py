"""A small Kubernetes API server for the tests, on 127.0.0.1 (aiohttp), spoken to over real HTTP
by kubernetes_asyncio: create (strict validation: tests/support/kubernetes_schemas.py; 404 for a
missing namespace, 409 AlreadyExists, 422 Invalid with causes), get, list with equality label
selectors, watch (newline-delimited events), delete (owned objects go too unless
propagationPolicy is Orphan: by their ownerReferences, and pods a test made with the run's job
label; a pod whose container runs is deleted gracefully: its deletionTimestamp set, removed by the
kubelet once stopped), pods' logs (followed while the container runs), and API discovery of the
JobSet group. It is no apiserver: no defaulting, admission, controllers or
resourceVersion semantics beyond a counter (../shared/KUBERNETES.md)."""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from frenzy_prefect.launch.kubernetes_manifest import JOB_LABEL, JOBSET_API
from tests.support.kubernetes_schemas import Invalid, validate

KINDS = {
    "nodes": ("v1", "Node"),
    "pods": ("v1", "Pod"),
    "services": ("v1", "Service"),
    "secrets": ("v1", "Secret"),
    "jobs": ("batch/v1", "Job"),
    "jobsets": (JOBSET_API, "JobSet"),
}


def status(code: int, reason: str, message: str, causes: list[tuple[str, str]] | None = None) -> web.Response:
    body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message, "reason": reason}
    body["code"] = code
    if causes:
        body["details"] = {"causes": [{"field": f, "message": m, "reason": "FieldValueInvalid"} for f, m in causes]}
    return web.json_response(body, status=code)


class ApiServer:
    def __init__(self, namespaces: tuple[str, ...] = ("default",), jobset: bool = True) -> None:
        self.namespaces, self.jobset = set(namespaces), jobset
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (plural, namespace, name)
        self.version = 0
        self.watchers: list[tuple[str, str, dict[str, str], asyncio.Queue]] = []
        self.deletes: list[tuple[str, str, str | None]] = []  # (plural, name, propagationPolicy)
        self.logs: dict[str, str] = {}
        self.log_files: dict[str, tuple[Path, Callable[[], bool]]] = {}  # pod -> (its log, whether it still runs)
        self.graceful: Callable[[dict[str, Any]], bool] = lambda pod: False  # a pod the kubelet must stop first

    def app(self) -> web.Application:
        app = web.Application()
        for prefix in ("/api/{version}", "/apis/{group}/{version}"):
            app.router.add_get(prefix + "/namespaces/{ns}/pods/{name}/log", self.log)
            app.router.add_post(prefix + "/namespaces/{ns}/{plural}", self.create)
            app.router.add_get(prefix + "/namespaces/{ns}/{plural}", self.list)
            app.router.add_get(prefix + "/namespaces/{ns}/{plural}/{name}", self.get)
            app.router.add_delete(prefix + "/namespaces/{ns}/{plural}/{name}", self.delete)
        app.router.add_get("/apis/{group}/{version}", self.discovery)
        app.router.add_get("/api/v1/{plural}", self.list_all)  # nodes; pods of every namespace
        return app

    def _bump(self) -> str:
        self.version += 1
        return str(self.version)

    def put(self, plural: str, obj: dict[str, Any], event: str = "MODIFIED") -> None:
        """Store ``obj`` (what a controller or the kubelet does) and tell the watchers."""
        meta = obj["metadata"]
        meta["resourceVersion"] = self._bump()
        self.objects[(plural, meta.get("namespace", "default"), meta["name"])] = obj
        self._notify(plural, event, obj)

    def _notify(self, plural: str, event: str, obj: dict[str, Any]) -> None:
        for p, ns, selector, queue in self.watchers:
            if p == plural and ns == obj["metadata"].get("namespace") and matches(obj, selector):
                queue.put_nowait({"type": event, "object": copy.deepcopy(obj)})

    async def discovery(self, request: web.Request) -> web.Response:
        if f"{request.match_info['group']}/{request.match_info['version']}" != JOBSET_API or not self.jobset:
            return status(404, "NotFound", "the server could not find the requested resource")
        resource = {
            "name": "jobsets",
            "singularName": "jobset",
            "namespaced": True,
            "kind": "JobSet",
            "verbs": ["create", "delete", "get", "list", "watch"],
        }
        return web.json_response({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": JOBSET_API, "resources": [resource]})

    def _kind_ok(self, request: web.Request, obj: dict[str, Any]) -> web.Response | None:
        plural, ns = request.match_info["plural"], request.match_info["ns"]
        if plural not in KINDS or (plural == "jobsets" and not self.jobset):
            return status(404, "NotFound", "the server could not find the requested resource")
        if (obj.get("apiVersion"), obj.get("kind")) != KINDS[plural]:
            return status(400, "BadRequest", f"the API version in the data ({obj.get('apiVersion')}) does not match {KINDS[plural][0]}")
        if ns not in self.namespaces:
            return status(404, "NotFound", f'namespaces "{ns}" not found')
        return None

    async def create(self, request: web.Request) -> web.Response:
        obj = await request.json()
        if refused := self._kind_ok(request, obj):
            return refused
        plural, ns = request.match_info["plural"], request.match_info["ns"]
        name = obj.get("metadata", {}).get("name", "")
        try:
            validate(obj)
        except Invalid as exc:
            return status(422, "Invalid", f'{KINDS[plural][1]} "{name}" is invalid: {exc}', exc.causes)
        if (plural, ns, name) in self.objects:
            return status(409, "AlreadyExists", f'{plural} "{name}" already exists')
        obj["metadata"] |= {"namespace": ns, "uid": str(uuid.uuid4()), "creationTimestamp": "2026-12-02T00:00:00Z"}
        self.put(plural, obj, "ADDED")
        return web.json_response(obj, status=201)

    async def get(self, request: web.Request) -> web.Response:
        m = request.match_info
        obj = self.objects.get((m["plural"], m["ns"], m["name"]))
        return web.json_response(obj) if obj else status(404, "NotFound", f'{m["plural"]} "{m["name"]}" not found')

    async def list(self, request: web.Request) -> web.StreamResponse:
        plural, ns = request.match_info["plural"], request.match_info["ns"]
        selector = _selector(request.query.get("labelSelector", ""))
        if request.query.get("watch", "").lower() in ("true", "1"):
            return await self._watch(request, plural, ns, selector)
        items = [o for (p, n, _), o in self.objects.items() if p == plural and n == ns and matches(o, selector)]
        kind = KINDS.get(plural, ("v1", "List"))
        return web.json_response(
            {"kind": f"{kind[1]}List", "apiVersion": kind[0], "metadata": {"resourceVersion": str(self.version)}, "items": items}
        )

    async def list_all(self, request: web.Request) -> web.Response:
        plural = request.match_info["plural"]
        items = [o for (p, _, _), o in self.objects.items() if p == plural]
        return web.json_response(
            {"kind": f"{KINDS[plural][1]}List", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.version)}, "items": items}
        )

    async def _watch(self, request: web.Request, plural: str, ns: str, selector: dict[str, str]) -> web.StreamResponse:
        queue: asyncio.Queue = asyncio.Queue()
        entry = (plural, ns, selector, queue)
        self.watchers.append(entry)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        try:
            timeout = float(request.query.get("timeoutSeconds", "30"))
            while True:
                event = await asyncio.wait_for(queue.get(), timeout)
                await response.write(json.dumps(event).encode() + b"\n")
        except (TimeoutError, ConnectionResetError):
            pass
        finally:
            self.watchers.remove(entry)
        return response

    async def delete(self, request: web.Request) -> web.Response:
        m = request.match_info
        body = await request.json() if request.can_read_body else {}
        policy = body.get("propagationPolicy") or request.query.get("propagationPolicy")
        obj = self.objects.get((m["plural"], m["ns"], m["name"]))
        if obj is None:
            return status(404, "NotFound", f'{m["plural"]} "{m["name"]}" not found')
        self.deletes.append((m["plural"], m["name"], policy))
        self._delete(m["plural"], obj, cascade=policy != "Orphan")
        return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"})

    def _delete(self, plural: str, obj: dict[str, Any], cascade: bool) -> None:
        """Delete ``obj`` and, with ``cascade``, what it owns; a pod whose container runs only gets its deletionTimestamp."""
        if plural == "pods" and self.graceful(obj):
            if not obj["metadata"].get("deletionTimestamp"):
                self.put(plural, {**obj, "metadata": {**obj["metadata"], "deletionTimestamp": "2026-12-02T00:00:01Z"}})
            return
        self.remove(plural, obj)
        if not cascade:
            return
        uid, job = obj["metadata"].get("uid"), obj["metadata"].get("labels", {}).get(JOB_LABEL)
        for (p, _, _), child in list(self.objects.items()):
            owners = child["metadata"].get("ownerReferences") or []
            by_label = p == "pods" and not owners and job and child["metadata"].get("labels", {}).get(JOB_LABEL) == job
            if by_label or any(o.get("uid") == uid for o in owners):
                self._delete(p, child, cascade)

    def remove(self, plural: str, obj: dict[str, Any]) -> None:
        """The object is gone: DELETED to its watchers."""
        meta = obj["metadata"]
        if self.objects.pop((plural, meta.get("namespace", "default"), meta["name"]), None) is not None:
            self._notify(plural, "DELETED", obj)

    async def log(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name in self.logs:
            return web.Response(text=self.logs[name])
        if name not in self.log_files:
            return status(404, "NotFound", f'pods "{name}" not found')
        path, running = self.log_files[name]
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        follow = request.query.get("follow", "").lower() in ("true", "1")
        with open(path, "rb") as f:
            while True:
                alive = running()
                if chunk := f.read():
                    await response.write(chunk)
                elif not (follow and alive):
                    break
                else:
                    await asyncio.sleep(0.1)
        await response.write_eof()
        return response


def _selector(text: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in text.split(",") if "=" in part)


def matches(obj: dict[str, Any], selector: dict[str, str]) -> bool:
    labels = obj.get("metadata", {}).get("labels", {}) or {}
    return all(labels.get(k) == v for k, v in selector.items())


def serve_in_thread(server: ApiServer):
    """Serve ``server`` on 127.0.0.1 from a thread of its own (for processes the test starts):
    (its URL, a function that stops it, its event loop)."""
    import threading

    loop = asyncio.new_event_loop()
    ready: list[str] = []

    async def start() -> web.AppRunner:
        # (a client gone cancels its handler, as for a watch whose client exited; what is left
        # at the stop gets 2 s to finish)
        runner = web.AppRunner(server.app(), handler_cancellation=True, shutdown_timeout=2.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        ready.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")  # type: ignore[union-attr]
        return runner

    runner = loop.run_until_complete(start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    return ready[0], stop, loop


def kubeconfig(url: str) -> dict[str, Any]:
    """A kubeconfig (what a KubernetesClusterConfig block holds) for the server at ``url``."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": {"server": url}}],
        "users": [{"name": "test", "user": {"token": "test-token"}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
        "current-context": "test",
    }
