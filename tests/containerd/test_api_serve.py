"""The local gRPC API of a real ``cri-prober serve`` on containerd.

Health (every name form, Watch), reflection, the transition stream and its incarnation, RunProbe,
TriggerProbe, hostile filters and oversized requests, and the socket itself, through stock gRPC
stubs. One daemon serves the whole module; each test makes its own uniquely named pods.
"""

from __future__ import annotations

import asyncio
import json
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cri_prober._gen.criprober.v1 import query_pb2, query_pb2_grpc
from tests.support.serve import (
    Serve,
    check,
    get,
    read_until,
    settled,
    start_serve,
    touch_ready,
    unique,
    wait_status,
)
from tests.support.testbed import ContainerSpec, PodFactory, Testbed
from tests.support.waiting import HANG_GUARD

# Generous timeouts: a loaded CI machine must not turn a slow exec into a probe failure.
RULES = """
probes:
  - match: {namespace: default, pod: "flip-*", container: app}
    readinessProbe: {exec: {command: [cat, /tmp/ready]}, periodSeconds: 1, timeoutSeconds: 10}
    livenessProbe: {exec: {command: ["true"]}, periodSeconds: 1, timeoutSeconds: 10}
  # Probed only when triggered: its first tick falls in the start-up jitter (serve started less
  # than a period ago) and its phase is drawn from the period, both up to three years away (an
  # hour was not enough: a draw landed within a test's seconds about once in a thousand runs).
  - match: {namespace: default, pod: "calm-*", container: app}
    readinessProbe:
      exec: {command: [cat, /tmp/ready]}
      periodSeconds: 100000000
      timeoutSeconds: 10
"""
READY_APP = ContainerSpec("app", command=["sh", "-c", "touch /tmp/ready; exec sleep 3600"])
UNREADY_APP = ContainerSpec("app")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


@pytest.fixture(scope="module", name="serve")
def _serve(testbed_16: Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    with start_serve(testbed_16, tmp_path_factory.mktemp("api"), RULES) as serve:
        yield serve


class TestHealth:
    async def test_every_name_form_is_serving(self, pods_16: PodFactory, health: Any) -> None:
        """A ready container is SERVING by ns/pod/container, ID, ID prefix and ns/pod; "" too."""
        pod = await pods_16.create_pod(unique("flip"), containers=[READY_APP])
        container_id = pod.containers["app"].id
        await wait_status(health, f"default/{pod.name}/app", SERVING)
        for name in (
            f"default/{pod.name}/app",
            container_id,
            container_id[:12],
            f"default/{pod.name}",
            "",
        ):
            assert await check(health, name) == SERVING, name

    async def test_unknown_names_are_not_found(self, health: Any) -> None:
        """Check on a name that picks no container or pod fails with NOT_FOUND."""
        for name in ("default/no-such-pod/app", "default/no-such-pod", "not-an-id", "a/b/c/d"):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await check(health, name)
            assert error.value.code() == grpc.StatusCode.NOT_FOUND, name

    async def test_watch_sees_readiness_arrive(
        self, pods_16: PodFactory, health: Any, testbed_16: Testbed
    ) -> None:
        """Watch reports NOT_SERVING, then SERVING once the readiness file appears."""
        pod = await pods_16.create_pod(unique("flip"), containers=[UNREADY_APP])
        name = f"default/{pod.name}/app"
        call = health.Watch(health_pb2.HealthCheckRequest(service=name))
        try:
            await read_until(call, lambda response: response.status == NOT_SERVING)
            assert await check(health, f"default/{pod.name}") == NOT_SERVING
            await touch_ready(testbed_16, pod.containers["app"].id)
            seen = await read_until(call, lambda response: response.status == SERVING)
        finally:
            call.cancel()
        assert [response.status for response in seen] == [SERVING]
        assert await check(health, f"default/{pod.name}") == SERVING

    async def test_watch_of_unknown_name_stays_open(self, health: Any) -> None:
        """Watch on an unknown name sends SERVICE_UNKNOWN and keeps the stream open."""
        call = health.Watch(health_pb2.HealthCheckRequest(service="default/no-such-pod/app"))
        try:
            first = await asyncio.wait_for(call.read(), HANG_GUARD)
            assert first.status == SERVICE_UNKNOWN
            with pytest.raises(TimeoutError):  # a window for what must not come
                await asyncio.wait_for(call.read(), 1)
        finally:
            call.cancel()


class TestReflection:
    async def test_lists_every_service(self, channel: grpc.aio.Channel) -> None:
        """Reflection lists criprober.v1, grpc.health.v1 and itself, and describes CriProber."""
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="criprober.v1.CriProber"),
        ]
        responses = [response async for response in stub.ServerReflectionInfo(iter(requests))]
        names = {service.name for service in responses[0].list_services_response.service}
        assert {
            "criprober.v1.CriProber",
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        } <= names
        assert responses[1].file_descriptor_response.file_descriptor_proto


class TestWatchTransitions:
    async def test_in_order_and_resumable(
        self, pods_16: PodFactory, api: query_pb2_grpc.CriProberAsyncStub, testbed_16: Testbed
    ) -> None:
        """Transitions arrive in sequence order; resuming replays exactly those that followed."""
        pod = await pods_16.create_pod(unique("flip"), containers=[UNREADY_APP])
        only_pod = query_pb2.ContainerFilter(pod=f"^{pod.name}$")
        request = query_pb2.WatchTransitionsRequest(filter=only_pod, since_sequence=0)
        initial = {("readiness", "failure"), ("liveness", "success")}
        got: set[tuple[str, str]] = set()

        def initial_values_seen(transition: query_pb2.Transition) -> bool:
            got.add((transition.kind, transition.result))
            return initial <= got

        call = api.WatchTransitions(request)
        try:
            metadata: Any = await call.initial_metadata()
            incarnation = metadata["criprober-incarnation"]
            seen = await read_until(call, initial_values_seen)
            await touch_ready(testbed_16, pod.containers["app"].id)
            seen += await read_until(
                call, lambda t: t.kind == "readiness" and t.result == "success"
            )
            if not seen[-1].healthy:
                # Liveness published a failure if its first step caught the container created
                # but not yet started (as the kubelet does); its next step recovers.
                seen += await read_until(call, lambda t: t.healthy)
        finally:
            call.cancel()

        sequences = [t.sequence for t in seen]
        assert sorted(set(sequences)) == sequences
        readiness = [t for t in seen if t.kind == "readiness"]
        assert [(t.previous, t.result) for t in readiness] == [
            ("", "failure"),
            ("failure", "success"),
        ]
        assert (readiness[-1].started, readiness[-1].ready) == (True, True)
        assert {pod.name} == {t.pod_name for t in seen}
        assert {pod.containers["app"].id} == {t.container_id for t in seen}
        assert seen[-1].healthy
        assert {t.incarnation for t in seen} == {incarnation}
        assert len(incarnation) == 16

        resumed = api.WatchTransitions(
            query_pb2.WatchTransitionsRequest(
                filter=only_pod, since_sequence=seen[0].sequence, incarnation=incarnation
            )
        )
        try:
            replay = await read_until(resumed, lambda t: t.sequence == sequences[-1], timeout=5)
        finally:
            resumed.cancel()
        assert [t.sequence for t in replay] == sequences[1:]

    async def test_unusable_resume_points_are_refused(
        self, api: query_pb2_grpc.CriProberAsyncStub
    ) -> None:
        """Never issued or another incarnation's: OUT_OF_RANGE; no incarnation: INVALID_ARGUMENT."""
        live = api.WatchTransitions(query_pb2.WatchTransitionsRequest())
        try:
            metadata: Any = await live.initial_metadata()
        finally:
            live.cancel()
        incarnation = metadata["criprober-incarnation"]
        cases = [
            (10**12, incarnation, grpc.StatusCode.OUT_OF_RANGE, "never issued"),
            (1, "0ld0ld0ld0ld0ld0", grpc.StatusCode.OUT_OF_RANGE, "belongs to incarnation"),
            (1, "", grpc.StatusCode.INVALID_ARGUMENT, "needs the incarnation"),
        ]
        for since, claimed, code, text in cases:
            request = query_pb2.WatchTransitionsRequest(since_sequence=since, incarnation=claimed)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await api.WatchTransitions(request).read()
            assert error.value.code() == code, since
            assert text in (error.value.details() or "")


class TestRunProbe:
    async def test_reports_result_output_and_exit_code(
        self, pods_16: PodFactory, api: query_pb2_grpc.CriProberAsyncStub
    ) -> None:
        """RunProbe runs the given spec once and answers with its verdict and output."""
        pod = await pods_16.create_pod(unique("calm"), containers=[UNREADY_APP])
        target = f"default/{pod.name}/app"
        await settled(api, target, lambda c: c.probes.HasField("readiness"))
        failing = json.dumps({"exec": {"command": ["sh", "-c", "echo hi; exit 3"]}})
        response = await api.RunProbe(
            query_pb2.RunProbeRequest(target=target, probe_json=failing), timeout=10
        )
        attempt = response.attempt
        assert (attempt.result, attempt.exit_code, attempt.output) == ("failure", 3, "hi\n")
        assert pod.containers["app"].id == attempt.container_id
        passing = json.dumps({"exec": {"command": ["true"]}})
        response = await api.RunProbe(
            query_pb2.RunProbeRequest(target=target, probe_json=passing, kind="readiness"),
            timeout=HANG_GUARD,
        )
        assert response.attempt.result == "success"

    @pytest.mark.parametrize(
        ("probe_json", "kind", "expected"),
        [
            ('{"exec": {"command": []}, "periodSeconds": -1}', "", "exec.command"),
            ('{"exec": {"command": []}, "periodSeconds": -1}', "", "periodSeconds"),
            ('{"exec": {"command": ["true"]}, "successThreshold": 2}', "", "successThreshold"),
            ("{not json", "", "not valid JSON"),
            ('{"exec": {"command": ["true"]}}', "sideways", "kind"),
        ],
    )
    async def test_invalid_spec_names_the_field(
        self, api: query_pb2_grpc.CriProberAsyncStub, probe_json: str, kind: str, expected: str
    ) -> None:
        """A bad spec or kind is INVALID_ARGUMENT naming the field path."""
        request = query_pb2.RunProbeRequest(target="x", probe_json=probe_json, kind=kind)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await api.RunProbe(request, timeout=HANG_GUARD)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert expected in (error.value.details() or "")

    async def test_unknown_target_is_not_found(
        self, api: query_pb2_grpc.CriProberAsyncStub
    ) -> None:
        """RunProbe on a container nobody has is NOT_FOUND."""
        request = query_pb2.RunProbeRequest(
            target="default/no-such-pod/app", probe_json='{"exec": {"command": ["true"]}}'
        )
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await api.RunProbe(request, timeout=HANG_GUARD)
        assert error.value.code() == grpc.StatusCode.NOT_FOUND

    async def test_changes_no_state(
        self, pods_16: PodFactory, api: query_pb2_grpc.CriProberAsyncStub
    ) -> None:
        """RunProbe leaves the published result, counters and history as they were."""
        pod = await pods_16.create_pod(unique("calm"), containers=[READY_APP])
        target = f"default/{pod.name}/app"
        await settled(api, target, lambda c: c.probes.HasField("readiness"))
        # The years-long period also means years of start-up jitter: probe it by hand. The pod
        # sync at the container's start left a readiness trigger pending (§3.8); like the
        # kubelet's buffered trigger it runs right after that first step: two attempts.
        trigger = query_pb2.TriggerProbeRequest(target=target, kind="readiness")
        await api.TriggerProbe(trigger, timeout=HANG_GUARD)
        before = await settled(api, target, lambda c: c.probes.readiness.attempts == 2)
        for command in (["false"], ["true"]):
            await api.RunProbe(
                query_pb2.RunProbeRequest(
                    target=target,
                    probe_json=json.dumps({"exec": {"command": command}}),
                    kind="readiness",
                ),
                timeout=HANG_GUARD,
            )
        after = await get(api, target)
        assert before.probes.readiness == after.probes.readiness
        assert (before.ready, before.healthy) == (after.ready, after.healthy)


class TestTriggerProbe:
    async def test_runs_now_and_is_rate_limited(
        self, pods_16: PodFactory, api: query_pb2_grpc.CriProberAsyncStub
    ) -> None:
        """A trigger runs the probe at once; a second within a second is RESOURCE_EXHAUSTED."""
        pod = await pods_16.create_pod(unique("calm"), containers=[READY_APP])
        target = f"default/{pod.name}/app"
        # Its first tick is in the start-up jitter (years away): only a trigger probes it.
        container = await settled(api, target, lambda c: c.probes.HasField("readiness"))
        attempts = container.probes.readiness.attempts
        request = query_pb2.TriggerProbeRequest(target=target, kind="readiness")
        response = await api.TriggerProbe(request, timeout=HANG_GUARD)
        assert (pod.containers["app"].id, "readiness") == (response.container_id, response.kind)
        # The trigger ends the jitter; the readiness trigger of the pod sync at the container's
        # start was pending (§3.8) and runs right after, as the kubelet's buffered one does.
        container = await settled(
            api, target, lambda c: c.probes.readiness.attempts == attempts + 2
        )
        assert container.probes.readiness.result == "success"
        assert container.ready

        with pytest.raises(grpc.aio.AioRpcError) as error:
            await api.TriggerProbe(request, timeout=HANG_GUARD)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        await asyncio.sleep(1.0)
        await api.TriggerProbe(request, timeout=HANG_GUARD)
        await settled(api, target, lambda c: c.probes.readiness.attempts == attempts + 3)

    @pytest.mark.parametrize(
        ("kind", "code"),
        [
            ("", grpc.StatusCode.INVALID_ARGUMENT),
            ("sideways", grpc.StatusCode.INVALID_ARGUMENT),
            ("startup", grpc.StatusCode.NOT_FOUND),
        ],
    )
    async def test_rejects_what_it_cannot_trigger(
        self,
        pods_16: PodFactory,
        api: query_pb2_grpc.CriProberAsyncStub,
        kind: str,
        code: grpc.StatusCode,
    ) -> None:
        """No kind, an unknown kind or a probe the container lacks cannot be triggered."""
        pod = await pods_16.create_pod(unique("calm"), containers=[READY_APP])
        target = f"default/{pod.name}/app"
        await settled(api, target, lambda c: c.probes.HasField("readiness"))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await api.TriggerProbe(query_pb2.TriggerProbeRequest(target=target, kind=kind))
        assert code == error.value.code()


class TestContainers:
    async def test_list_and_get(
        self, pods_16: PodFactory, api: query_pb2_grpc.CriProberAsyncStub
    ) -> None:
        """ListContainers filters like crictl ps; GetContainer adds the spec and history."""
        pod = await pods_16.create_pod(unique("flip"), containers=[READY_APP])
        target = f"default/{pod.name}/app"
        container = await settled(api, target, lambda c: c.probes.readiness.attempts >= 1)
        detail = container.probes.readiness.detail
        assert json.loads(detail.spec_json)["exec"]["command"] == ["cat", "/tmp/ready"]
        assert json.loads(detail.spec_json)["periodSeconds"] == 1
        assert detail.history
        assert not container.probes.HasField("startup")

        listed = await api.ListContainers(
            query_pb2.ListContainersRequest(filter=query_pb2.ContainerFilter(pod=pod.name))
        )
        assert [pod.containers["app"].id] == [c.id for c in listed.containers]
        assert not listed.containers[0].probes.readiness.HasField("detail")
        exited = await api.ListContainers(
            query_pb2.ListContainersRequest(
                filter=query_pb2.ContainerFilter(pod=pod.name),
                state=query_pb2.CONTAINER_EXITED,
            )
        )
        assert list(exited.containers) == []

    async def test_bad_filter_is_invalid_argument(
        self, api: query_pb2_grpc.CriProberAsyncStub
    ) -> None:
        """A filter that is not a valid regular expression is INVALID_ARGUMENT."""
        request = query_pb2.ListContainersRequest(filter=query_pb2.ContainerFilter(name="("))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await api.ListContainers(request)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


class TestHostileRequests:
    async def test_a_backtracking_filter_leaves_health_answering(
        self, pods_16: PodFactory, api: query_pb2_grpc.CriProberAsyncStub, health: Any, serve: Serve
    ) -> None:
        """The finding's filter against a 29-character pod name: health answers, and serve spends
        under a second of CPU on the listing and the health check together.

        Python's re needed ~18 s (of CPU) for it, with the daemon frozen (health timing out,
        probes stalled); RE2 matches in linear time. CPU seconds, not elapsed ones: a busy
        machine stretches the latter, not the former.
        """
        name = unique("calm") + "-backtracking-xy"  # 13 + 16 characters
        assert len(name) == 29
        await pods_16.create_pod(name, containers=[UNREADY_APP])
        await settled(api, f"default/{name}/app", lambda c: c.probes.HasField("readiness"))
        request = query_pb2.ListContainersRequest(
            filter=query_pb2.ContainerFilter(pod=r"^([a-z0-9-]+)+\.svc$"), all=True
        )
        cpu_before = serve.cpu_seconds()
        listing = asyncio.ensure_future(api.ListContainers(request, timeout=HANG_GUARD))
        assert await check(health, "") == SERVING
        listed = await listing
        cpu = serve.cpu_seconds() - cpu_before
        assert cpu < 1.0, cpu
        assert list(listed.containers) == []

    async def test_oversized_requests_are_refused_without_echo(
        self, api: query_pb2_grpc.CriProberAsyncStub, health: Any
    ) -> None:
        """Over 64 KiB: RESOURCE_EXHAUSTED; over a field's cap: refused quoting 128 characters."""
        spec = '{"exec": {"command": ["true"]}}'
        huge = query_pb2.RunProbeRequest(target="z" * 1_000_000, probe_json=spec)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await api.RunProbe(huge, timeout=HANG_GUARD)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        large = query_pb2.RunProbeRequest(target="z" * 60_000, probe_json=spec)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await api.RunProbe(large, timeout=HANG_GUARD)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "z" * 129 not in (error.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await health.Check(
                health_pb2.HealthCheckRequest(service="z" * 60_000), timeout=HANG_GUARD
            )
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        assert "z" * 129 not in (error.value.details() or "")


class TestSocket:
    def test_private_and_replaced_the_stale_one(self, serve: Serve) -> None:
        """The API socket is mode 0600 and replaced the stale socket file found at its path."""
        info = Path(serve.socket_path).stat()
        assert stat.S_ISSOCK(info.st_mode)
        assert stat.S_IMODE(info.st_mode) == 0o600
        assert "api_stale_socket_removed" in serve.log()
