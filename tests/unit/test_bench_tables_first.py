"""The benchmarks print what they measured before a failure in stopping (issue 35): on a loaded
machine the daemon's stop timed out after ``bench/run scale --sizes 5000``'s window and the run
printed no table at all. No containerd here: the windows and the stops are stand-ins."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

import bench.process_cpu as process_cpu
import bench.scale as scale
from bench._common import tables_first

STOP_FAILED = "the daemon did not stop within 60 s"


def row(out: str, *first: str) -> list[str]:
    """The cells of the printed table row whose first cells are ``first``."""
    for line in out.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and tuple(cells[: len(first)]) == first:
            return cells
    raise AssertionError(f"no row {first} in:\n{out}")


def test_tables_first_prints_the_tables_then_raises_the_failure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def report() -> None:
        print("| containers | late p99 ms |\n| 5000 | 31.4 |")

    with pytest.raises(TimeoutError, match=STOP_FAILED), tables_first(report):
        raise TimeoutError(STOP_FAILED)
    out, err = capsys.readouterr()
    assert "| 5000 | 31.4 |" in out
    assert f"the run failed after what it measured: TimeoutError: {STOP_FAILED}" in err


def test_tables_first_prints_the_tables_once_when_all_goes_well(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with tables_first(lambda: print("| table |")):
        pass
    out, err = capsys.readouterr()
    assert out.count("| table |") == 1
    assert "failed" not in err


def test_a_report_that_fails_does_not_hide_the_stops_failure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def report() -> None:
        raise ZeroDivisionError("no rounds")

    with pytest.raises(TimeoutError, match=STOP_FAILED), tables_first(report):
        raise TimeoutError(STOP_FAILED)
    assert "ZeroDivisionError('no rounds')" in capsys.readouterr().err


def size_result(containers: int) -> scale.SizeResult:
    sample = scale.Sample(
        cpu_pct=67.0, rss=204.0, tasks=10_001, loop_lag_max=0.05, loop_cpu_pct=67.0,
        runqueue_pct=3.0, loadavg=5.2,
    )  # fmt: skip
    return scale.SizeResult(
        containers=containers, seconds=90.0, probes_per_s=1000.0, late_p50=0.0002,
        late_p99=0.0314, late_max=0.055, dropped_pct=0.0, unsuccessful=0, cpu_pct=70.0,
        rss_start=200.0, rss_end=204.0, rss_baseline=60.0, tasks=10_001, loop_lag_p99=0.027,
        relist_p50=0.008, relist_p99=0.012, fake_cpu_pct=20.0, listeners_cpu_pct=10.0,
        startup_s=5.4, first_probes_s=10.0, scrape_p50=1.0, scrape_max=1.07, scrape_bytes=1.47e6,
        scrapes_failed=0, relist_alone_wall=9.0, relist_alone_cpu=8.6, timed_out=0,
        samples=[sample],
    )  # fmt: skip


def test_scale_prints_the_measured_size_when_the_daemons_stop_times_out(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def run_size(
        count: int, *args: object, measured: Callable[[scale.SizeResult], None], **kwargs: object
    ) -> scale.SizeResult:
        measured(size_result(count))  # the window is over: then the daemon's stop times out
        raise TimeoutError(STOP_FAILED)

    monkeypatch.setattr(scale, "run_size", run_size)
    monkeypatch.setattr(scale, "quiet_logs", lambda: None)
    args = argparse.Namespace(
        sizes=[5000], seconds=60.0, last_seconds=90.0, warmup=15.0, cpu_hog=False,
        scrape_every=15.0, profile=None, pauses=False, history_size=32, nice=0, loop="uvloop",
        tracemalloc=0, every_attempt=False,
    )  # fmt: skip
    with pytest.raises(TimeoutError, match=STOP_FAILED):
        asyncio.run(scale.run(args))
    out, err = capsys.readouterr()
    assert "## Scale on the fake CRI runtime" in out
    assert row(out, "5000", "90", "1000", "0.2")[4] == "31.4"  # the late p99, before the stop
    assert "node load average: 5.2" in out
    assert err.rindex("the run failed after what it measured") > 0


class FakePods:
    async def create_pod(self, name: str, **kwargs: object) -> SimpleNamespace:
        return SimpleNamespace(container_ids={"app": f"id-{name}"})


class FakeTestbed:
    endpoint = "unix:///nowhere/containerd.sock"
    pid = 1

    @contextlib.asynccontextmanager
    async def pods(self) -> AsyncIterator[FakePods]:
        yield FakePods()


@contextlib.asynccontextmanager
async def containerd_that_does_not_stop(version: str = "1.6") -> AsyncIterator[FakeTestbed]:
    yield FakeTestbed()
    raise TimeoutError(STOP_FAILED)


def window(contender: str, cpu: float) -> process_cpu.Window:
    return process_cpu.Window(
        contender=contender, cpu=cpu, probes=2000, failed=0, seconds=20.0, rss=60.0,
        containerd_cpu=0.05,
    )  # fmt: skip


def test_process_cpu_prints_its_rounds_when_containerds_stop_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def measure_serve(args: object, kind: str, *rest: object) -> process_cpu.Window:
        return window("serve", 1.3)  # 0.650 ms a probe

    async def measure_paced(
        args: object, kind: str, loop: str, *rest: object
    ) -> process_cpu.Window:
        return window(f"paced-{loop}", 0.65)  # 0.325 ms a probe

    @contextlib.contextmanager
    def listeners(**kwargs: int) -> Iterator[object]:
        yield object()

    monkeypatch.setattr(process_cpu, "containerd", containerd_that_does_not_stop)
    monkeypatch.setattr(process_cpu, "listeners", listeners)
    monkeypatch.setattr(process_cpu, "ports", lambda child, kind: [1, 2, 3, 4])
    monkeypatch.setattr(process_cpu, "measure_serve", measure_serve)
    monkeypatch.setattr(process_cpu, "measure_paced", measure_paced)
    monkeypatch.setattr(process_cpu, "quiet_logs", lambda: None)
    args = argparse.Namespace(
        kinds=["http"], targets=4, exec_targets=0, ports=4, paced_loop="uvloop",
        paced_exec=["aio"], paced_http=["streams"], rounds=2, seconds=20.0, warmup=3.0,
        serve_from=Path("/snap"), serve_arg=[], serve_python={}, serve_before=None, profile=None,
        together=False, serve_also={}, cpu_hog=0, trace_execs=False,
    )  # fmt: skip
    with pytest.raises(TimeoutError, match=STOP_FAILED):
        asyncio.run(process_cpu.run(args))
    out, err = capsys.readouterr()
    assert row(out, "http", "serve")[2:4] == ["0.650 / 0.650", "**0.650**"]
    assert row(out, "http", "serve / paced-uvloop")[2:4] == ["2.00 / 2.00", "**2.00**"]
    assert "Load average before:" in out
    assert "the run failed after what it measured: TimeoutError" in err


def test_process_cpu_says_a_run_was_partial(capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(
        kinds=["http", "tcp"], targets=4, exec_targets=0, ports=4, rounds=4, seconds=20.0,
        warmup=3.0, serve_from=Path("/snap"), serve_arg=[], serve_python={}, profile=None,
        serve_before=None, serve_also={},
    )  # fmt: skip
    rounds = [{"serve": window("serve", 1.3), "paced-uvloop": window("paced-uvloop", 0.65)}]
    contenders = {"http": ["serve", "paced-uvloop"], "tcp": ["serve", "paced-uvloop"]}
    process_cpu.report(args, contenders, {"http": rounds, "tcp": []}, "5.00 / 4.00 / 3.00")
    out = capsys.readouterr().out
    assert "**A partial run**: rounds measured, of 4 asked: http 1, tcp 0." in out
    assert row(out, "http", "serve / paced-uvloop")[2:4] == ["2.00", "**2.00**"]
    assert not any(line.startswith("| tcp") for line in out.splitlines())


def test_process_cpu_prints_serve_before_and_the_protocol_loop_ratios(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Issue 36: two versions of serve in the same rounds, each over the Protocol loop.
    args = argparse.Namespace(
        kinds=["http"], targets=4, exec_targets=0, ports=4, rounds=1, seconds=20.0, warmup=3.0,
        serve_from=Path("/snap"), serve_arg=[], serve_python={}, profile=None,
        serve_before=Path("/base"), paced_loop="uvloop", paced_exec=["aio"],
        paced_http=["protocol", "streams"], serve_also={"before": Path("/base")},
    )  # fmt: skip
    contenders = {"http": process_cpu.paced_contenders(args, "http")}
    assert contenders["http"] == [
        "serve", "serve-before", "paced-uvloop-protocol", "paced-uvloop",
    ]  # fmt: skip
    assert process_cpu.paced_variant("paced-uvloop-protocol", "http") == ("uvloop", "protocol")
    assert process_cpu.paced_variant("paced-uvloop", "http") == ("uvloop", "streams")
    assert process_cpu.paced_variant("paced-uvloop", "exec") == ("uvloop", "aio")
    rounds = [
        {
            "serve": window("serve", 1.3),
            "serve-before": window("serve-before", 2.6),
            "paced-uvloop-protocol": window("paced-uvloop-protocol", 0.325),
            "paced-uvloop": window("paced-uvloop", 0.65),
        }
    ]
    process_cpu.report(args, contenders, {"http": rounds}, "1.00 / 1.00 / 1.00")
    out = capsys.readouterr().out
    assert row(out, "http", "serve / serve-before")[2:4] == ["0.50", "**0.50**"]
    assert row(out, "http", "serve / paced-uvloop-protocol")[2:4] == ["4.00", "**4.00**"]
    assert row(out, "http", "serve-before / paced-uvloop-protocol")[2:4] == ["8.00", "**8.00**"]
    assert row(out, "http", "serve-before / paced-uvloop")[2:4] == ["4.00", "**4.00**"]
    assert "serve-before from /base" in out


def test_process_cpu_paced_child_gets_its_kinds_mode() -> None:
    argv = process_cpu.paced_child_argv("http", "uvloop", "unix:///x", ["1"], "protocol")
    assert argv[argv.index("--paced-http") + 1] == "protocol"
    argv = process_cpu.paced_child_argv("exec", "uvloop", "unix:///x", ["c"], "thread")
    assert argv[argv.index("--paced-exec") + 1] == "thread"
