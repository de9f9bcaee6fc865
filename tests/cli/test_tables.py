"""The client's human output, built from API messages without a daemon: ``ps`` and ``watch``
widths on the demo's listing and on long Kubernetes names, ``inspect``'s summary, durations
as people write them and ``version``'s labelled lines.
"""

from __future__ import annotations

import json

import pytest
from google.protobuf import duration_pb2, timestamp_pb2

from cri_prober._gen.criprober.v1 import query_pb2
from cri_prober.cli.tables import (
    PS_HEADERS,
    WATCH_COLUMNS,
    container_summary,
    cut,
    history_text,
    not_serving_lines,
    probes_cell,
    ps_row,
    short_duration,
    table,
    transition_cells,
    watch_line,
)
from cri_prober.cli.version import version_lines
from cri_prober.runtime.model import RuntimeVersion

NOW = 1_790_000_000.0
LONG_ID = "4857b031d6f2a9e0c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f6a7b8c9d0e1f2a3b4"


def ts(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def status(result: str, origin: str = "rules") -> query_pb2.ProbeStatus:
    return query_pb2.ProbeStatus(result=result, origin=origin, active=True)


def container(
    pod: str,
    name: str,
    namespace: str = "demo",
    age: float = 154,
    **probes: query_pb2.ProbeStatus,
) -> query_pb2.Container:
    return query_pb2.Container(
        id=LONG_ID,
        name=name,
        pod_name=pod,
        pod_namespace=namespace,
        state=query_pb2.CONTAINER_RUNNING,
        created_at=ts(NOW - age),
        started=True,
        ready=True,
        healthy=True,
        probes=query_pb2.Probes(**probes),
    )


# What scripts/demo.sh runs, with every probe its rules and manifest configure, failing where
# it can: the widest its `ps` gets.
DEMO = [
    container("shop-demo-node", "app", age=9.7, liveness=status("success", "pod-spec"),
              readiness=status("failure", "pod-spec")),
    container("grpc-api", "api", readiness=status("failure")),
    container("tcp-echo", "nc", readiness=status("success")),
    container("slow-starter", "main", liveness=status("failure"),
              readiness=status("failure"), startup=status("unknown")),
    container("worker", "main", liveness=status("failure")),
    container("web", "httpd", liveness=status("success"), readiness=status("failure")),
]  # fmt: skip
# Names as long as Kubernetes makes them: a Deployment's pod, a long namespace and container.
LONG = [
    container(
        "checkout-api-canary-europe-west1-7f9c8d6b54-x2k4q",
        "istio-proxy-sidecar-for-checkout",
        namespace="payments-production-eu",
        liveness=status("failure"),
        readiness=status("failure"),
        startup=status("failure"),
    )
]


def ps_lines(containers: list[query_pb2.Container], *, no_trunc: bool = False) -> list[str]:
    rows = [ps_row(c, NOW, no_trunc=no_trunc) for c in containers]
    return table(PS_HEADERS, rows, gap=2).splitlines()


class TestPsWidth:
    def test_demo_listing_leaves_room_in_120_columns(self) -> None:
        """The demo's listing is at most 105 columns (was 158): 15 left for a reason."""
        lines = ps_lines(DEMO)
        assert max(map(len, lines)) <= 105, "\n".join(lines)
        assert lines[0].split() == list(PS_HEADERS)
        assert lines[1].split()[:2] == [LONG_ID[:13], "demo/shop-demo-node"]
        assert "L:ok R:fail" in lines[1]
        assert "L:fail R:fail S:?" in lines[4]
        assert lines[1].split()[-1] == "9s"  # whole seconds in an age
        assert lines[2].split()[-1] == "2m34s"

    def test_long_names_are_cut_in_the_middle_within_120(self) -> None:
        """Long names are cut to fit, keeping both ends (a pod's hash suffix tells replicas
        apart); --no-trunc prints them and the full ID whole."""
        lines = ps_lines(LONG)
        assert max(map(len, lines)) <= 120, "\n".join(lines)
        pod = lines[1].split()[1]
        assert pod.startswith("payments-prod")
        assert pod.endswith("b54-x2k4q")
        assert "…" in pod
        whole = ps_lines(LONG, no_trunc=True)[1].split()
        assert whole[:3] == [
            LONG_ID,
            "payments-production-eu/checkout-api-canary-europe-west1-7f9c8d6b54-x2k4q",
            "istio-proxy-sidecar-for-checkout",
        ]


class TestWatchWidth:
    def transition(self, pod: str, namespace: str, name: str) -> query_pb2.Transition:
        return query_pb2.Transition(
            sequence=123456, time=ts(NOW), container_id=LONG_ID, container_name=name,
            pod_name=pod, pod_namespace=namespace, kind="readiness", previous="success",
            result="failure", reason="connection-refused", consecutive=3, threshold=3, held=True,
        )  # fmt: skip

    @pytest.mark.parametrize(
        ("pod", "namespace", "name"),
        [
            ("shop-demo-node", "demo", "app"),
            ("checkout-api-canary-europe-west1-7f9c8d6b54-x2k4q", "payments-production-eu",
             "istio-proxy-sidecar-for-checkout"),
        ],
    )  # fmt: skip
    def test_a_line_fits_120_columns(self, pod: str, namespace: str, name: str) -> None:
        """A transition line is at most 120 columns (was 128 without a reason), with the
        longest reason, its count and the hold."""
        header = watch_line([h for h, _ in WATCH_COLUMNS], no_trunc=False)
        line = watch_line(transition_cells(self.transition(pod, namespace, name), no_trunc=False),
                          no_trunc=False)  # fmt: skip
        assert len(line) <= 120, line
        assert line.endswith("ok -> fail      connection-refused 3/3 held"), line
        assert header.index("POD") == line.index(namespace[:5])
        assert line.split()[2] == LONG_ID[:13]

    def test_no_trunc_keeps_everything(self) -> None:
        cells = transition_cells(self.transition("p" * 40, "ns", "c" * 30), no_trunc=True)
        line = watch_line(cells, no_trunc=True)
        assert LONG_ID in line
        assert "ns/" + "p" * 40 in line
        assert "c" * 30 in line


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0ms"),
        (0.13, "130ms"),
        (0.129999999, "130ms"),
        (0.9996, "1s"),
        (1.5, "1.5s"),
        (2.0, "2s"),
        (12.4, "12s"),
        (60, "1m"),
        (123, "2m3s"),
        (3900, "1h5m"),
        (86400 * 3 + 3600 * 4, "3d4h"),
    ],
)
def test_short_duration(seconds: float, text: str) -> None:
    """Durations read as people write them, not as protobuf's "0.129999999s"."""
    assert short_duration(seconds) == text


def test_cut_keeps_both_ends() -> None:
    assert cut("abcdefghij", 10) == "abcdefghij"
    assert cut("abcdefghijk", 10) == "abcde…hijk"
    assert len(cut("x" * 100, 26)) == 26


def attempt(result: str, at: float, **fields: object) -> query_pb2.ProbeAttempt:
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(int(0.13 * 1e9))
    return query_pb2.ProbeAttempt(time=ts(at), duration=duration, result=result, **fields)  # type: ignore[arg-type]


class TestInspectSummary:
    def worker(self) -> query_pb2.Container:
        spec = {"exec": {"command": ["cat", "/tmp/alive"]}, "periodSeconds": 2,
                "timeoutSeconds": 1, "successThreshold": 1, "failureThreshold": 2}  # fmt: skip
        history = [attempt("success", NOW - 20 + i) for i in range(12)]
        history += [attempt("failure", NOW - 4), attempt("failure", NOW - 2)]
        output = "cat: can't open '/tmp/alive': No such file or directory\n" + "x" * 300
        last = attempt("failure", NOW - 2, exit_code=1, output=output)
        liveness = query_pb2.ProbeStatus(
            result="failure", consecutive_failures=2, on_hold=True, active=True, attempts=14,
            last_attempt=last, origin="rules", source="examples/demo/rules.yaml",
            detail=query_pb2.ProbeDetail(spec_json=json.dumps(spec), history=history),
        )  # fmt: skip
        c = container("worker", "main", liveness=liveness)
        c.healthy = False
        return c

    def test_one_block_per_probe_with_what_matters(self) -> None:
        """The held failing liveness probe: kind, handler, result and hold, counts, the last
        attempt (time, duration, exit code, output on one truncated line), history as runs."""
        lines = container_summary(self.worker(), NOW)
        assert lines[0] == f"ID: {LONG_ID}"
        assert "Name: demo/worker/main" in lines
        assert "Startup passed: true   Ready: true   Healthy: false" in lines
        assert "Liveness probe: exec [cat /tmp/alive], every 2s, timeout 1s" in lines
        assert "  Result: failure, on hold until the container restarts (no attempts)" in lines
        assert (
            "  In a row: 0 successes, 2 failures (thresholds: success 1, failure 2); "
            "14 attempts in all" in lines
        )
        last = next(line for line in lines if line.startswith("  Last attempt: "))
        assert last.endswith("(2s ago), took 130ms: failure, exit code 1")
        output = next(line for line in lines if line.startswith("  Output: "))
        assert output.startswith("  Output: cat: can't open '/tmp/alive'")
        assert len(output) <= 120
        assert output.endswith("…")
        assert "  History: success x12, failure x2 (oldest first, 14 kept)" in lines
        assert max(map(len, lines)) <= 120
        assert len(lines) < 20

    def test_no_trunc_prints_the_whole_output(self) -> None:
        lines = container_summary(self.worker(), NOW, no_trunc=True)
        output = next(line for line in lines if line.startswith("  Output: "))
        assert output.endswith("x" * 300)

    def test_history_when_empty(self) -> None:
        assert history_text([]) == "none kept"


def test_version_lines_label_the_cri_api_version() -> None:
    """Every line says what it is: the unlabelled ``Version:`` (the CRI API's) is labelled after
    its value, crictl's keys kept, so ``awk '$1 == "Version:" {print $2}'`` still works."""
    info = RuntimeVersion("0.1.0", "containerd", "v1.7.24", "v1")
    lines = version_lines("0.1.0", "unix:///run/containerd/containerd.sock", info)
    assert lines[0] == "cri-prober version:  0.1.0"
    assert "RuntimeEndpoint:  unix:///run/containerd/containerd.sock" in lines
    versions = [line for line in lines if line.startswith("Version:")]
    assert versions == [
        "Version:  0.1.0  (CRI VersionResponse.version: the kubelet runtime API version)"
    ]
    assert versions[0].split()[1] == "0.1.0"
    assert lines[-3:] == [
        "RuntimeName:  containerd",
        "RuntimeVersion:  v1.7.24",
        "RuntimeApiVersion:  v1",
    ]


class TestReasons:
    """Issue 24: initial values are not flaps, and failures carry their reason."""

    def test_an_initial_value_is_marked_as_such(self) -> None:
        initial = query_pb2.Transition(
            time=ts(NOW), container_id=LONG_ID, kind="readiness", result="failure",
            reason="initial",
        )  # fmt: skip
        cells = transition_cells(initial, no_trunc=False)
        assert cells[-2:] == ["(initial) fail", "initial"]
        counted = query_pb2.Transition(
            time=ts(NOW), container_id=LONG_ID, kind="liveness", previous="success",
            result="failure", reason="timeout", consecutive=3, threshold=3,
        )  # fmt: skip
        assert transition_cells(counted, no_trunc=False)[-2:] == ["ok -> fail", "timeout 3/3"]

    def test_ps_probes_cell_says_why_a_probe_fails_and_whether_it_holds(self) -> None:
        probes = query_pb2.Probes(
            liveness=query_pb2.ProbeStatus(
                result="failure", hold="on hold until the container restarts",
                last_attempt=query_pb2.ProbeAttempt(reason="http-status"),
            ),
            readiness=query_pb2.ProbeStatus(
                result="failure", last_attempt=query_pb2.ProbeAttempt(reason="timeout")
            ),
            startup=query_pb2.ProbeStatus(result="success", hold="passed"),
        )  # fmt: skip
        assert probes_cell(probes) == "L:fail(http-status,held) R:fail(timeout) S:ok"

    def test_not_serving_lines_name_the_probe_its_reason_count_and_output(self) -> None:
        container = query_pb2.Container(
            name="app", pod_name="web", pod_namespace="shop",
            state=query_pb2.CONTAINER_RUNNING,
            probes=query_pb2.Probes(
                liveness=query_pb2.ProbeStatus(result="success"),
                readiness=query_pb2.ProbeStatus(
                    result="failure",
                    last_attempt=query_pb2.ProbeAttempt(
                        result="failure", reason="connection-refused", run=3, threshold=3,
                        output="dial tcp 10.0.0.7:8080: connect: connection refused",
                    ),
                ),
            ),
        )  # fmt: skip
        assert not_serving_lines([container]) == [
            "shop/web/app: readiness failure (connection-refused 3/3): "
            "dial tcp 10.0.0.7:8080: connect: connection refused"
        ]
