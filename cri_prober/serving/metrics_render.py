"""The exposition: choosing a format for an ``Accept`` header, and writing the per-worker series
in it byte for byte as prometheus_client's encoder would, only faster.

``Renderer`` fills in line templates that the encoder itself wrote; ``Metrics.exposition``
(``metrics.py``) uses it, and the encoder for everything else.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from cri_prober.serving.metrics_series import (
    ATTEMPT_DURATION,
    CONSECUTIVE_FAILURES,
    CONTAINER_FAMILIES,
    CONTAINER_READY,
    DURATION,
    LE_VALUES,
    ON_HOLD,
    TIMEOUTS,
    TOTAL,
    TRANSITIONS,
    ContainerSeries,
    Family,
    HistogramSeries,
    Shape,
    WorkerSeries,
    WorkerSeriesCollector,
    escape_label_value,
    go_float,
)

# The text exposition format generate_latest() writes, the answer to a request with no Accept.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def negotiate(accept: str | None) -> tuple[Callable[[Collector], bytes], str]:
    """prometheus_client's choice of encoder and content type for an ``Accept`` header.

    OpenMetrics when the header asks for it, the text format otherwise, and the text format too
    for a header prometheus_client cannot parse (a version that is not a number) or one that
    would put control characters into the answer's Content-Type.
    """
    try:
        encoder, content_type = choose_encoder(accept or "")
    except (TypeError, ValueError):
        return choose_encoder("")
    if not (content_type.isascii() and content_type.isprintable()):
        return choose_encoder("")
    return encoder, content_type


def _number(value: float) -> str:
    # floatToGoString's answer, without its work for the common case: below 10^6 an integer n
    # is written "n.0" (from there on, Go and so floatToGoString switch to exponents).
    if type(value) is int and 0 <= value < 1_000_000:
        return f"{value}.0"
    return go_float(value)


class _Families:
    """A fixed list of families, in the shape an encoder reads (``collect()``)."""

    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> list[Metric]:
        return self._metrics


@dataclass(frozen=True, slots=True)
class _Template:
    """How an encoder writes one sample shape, as format strings over escaped label values.

    ``line`` takes every label value, then the value, and ends the line. ``head`` and ``tail``
    take the values but the last; between them goes the last label's value (a histogram's
    ``le``, a counter's ``result``), after ``tail`` the value: a worker formats those two once
    and writes each of its lines with one concatenation.
    """

    line: str
    head: str
    tail: str


class Renderer:
    """The per-worker families in one exposition format, written as that format's encoder would.

    Each family's header and each sample shape's line are made once by the encoder itself, with
    placeholder label values (``_template``), then filled in for every sample. tests/unit/
    test_metrics.py checks ``Metrics.exposition`` against the encoder byte for byte, for every
    format and escaping.
    """

    def __init__(
        self, families: tuple[Family, ...], headers: list[str], templates: list[_Template]
    ):
        self._families = families
        self._headers = headers
        shapes = [shape for family in families for shape in family.shapes]
        self._templates = dict(zip(shapes, templates, strict=True))

    @classmethod
    def make(
        cls, encoder: Callable[[Collector], bytes], families: tuple[Family, ...]
    ) -> Renderer | None:
        """A renderer for ``encoder``'s format, or None when its output is not made of the
        pieces expected (then the encoder writes everything)."""
        headers = []
        templates = []
        for family in families:
            metric = Metric(family.name, family.documentation, family.type)
            header = encoder(_Families([metric])).decode()
            # OpenMetrics ends every exposition with "# EOF"; the rest of it follows this part.
            header = header.removesuffix("# EOF\n")
            if header.count("\n") != 2 or not header.startswith("# HELP "):
                return None
            headers.append(header)
            for shape in family.shapes:
                template = _template(encoder, family, shape)
                if template is None:
                    return None
                templates.append(template)
        return cls(families, headers, templates)

    def render(self, workers: WorkerSeriesCollector) -> Iterator[bytes]:
        """The families' lines, a piece per ``RENDER_BATCH`` workers (or containers), each made
        when it is read: whoever reads can give way between pieces (the metrics server gives
        the event loop a turn after each, so that no piece holds it for more than a few ms)."""
        snapshot = workers.snapshot()
        containers = workers.containers()
        for family, header in zip(self._families, self._headers, strict=True):
            yield header.encode()
            if family in CONTAINER_FAMILIES:
                for start in range(0, len(containers), RENDER_BATCH):
                    out: list[str] = []
                    self._gauges(out, family, containers[start : start + RENDER_BATCH])
                    yield "".join(out).encode()
                continue
            for start in range(0, len(snapshot), RENDER_BATCH):
                out = []
                self._family(out, family, snapshot[start : start + RENDER_BATCH])
                yield "".join(out).encode()

    def _gauges(self, out: list[str], family: Family, containers: list[ContainerSeries]) -> None:
        """The per-container 0/1 gauges (CONTAINER_FAMILIES)."""
        line = self._templates[family.shapes[0]].line
        ready = family is CONTAINER_READY
        for series in containers:
            value = series.ready if ready else series.started
            out.append(line.format(*series.escaped, "1.0" if value else "0.0"))

    def _family(self, out: list[str], family: Family, workers: list[WorkerSeries]) -> None:
        if family is TOTAL:
            self._totals(out, workers)
        elif family is DURATION:
            for worker in workers:
                if (histogram := worker.durations) is not None:
                    self._histogram(out, family, worker.escaped, histogram)
        elif family is ATTEMPT_DURATION:
            for worker in workers:
                for result, histogram in list(worker.attempts.items()):
                    labels = (*worker.escaped, escape_label_value(result))
                    self._histogram(out, family, labels, histogram)
        elif family is TRANSITIONS:
            line = self._templates[family.shapes[0]].line
            for worker in workers:
                for result, count in list(worker.transitions.items()):
                    out.append(line.format(*worker.escaped, result, _number(count)))
        elif family is TIMEOUTS:
            line = self._templates[family.shapes[0]].line
            for worker in workers:
                if worker.timeouts:
                    out.append(line.format(*worker.escaped, _number(worker.timeouts)))
        elif family is CONSECUTIVE_FAILURES:
            line = self._templates[family.shapes[0]].line
            for worker in workers:
                out.append(line.format(*worker.escaped, _number(worker.failing)))
        elif family is ON_HOLD:
            line = self._templates[family.shapes[0]].line
            for worker in workers:
                if worker.held:
                    out.append(line.format(*worker.escaped, _number(1)))

    def _totals(self, out: list[str], snapshot: list[WorkerSeries]) -> None:
        template = self._templates[TOTAL.shapes[0]]
        for worker in snapshot:
            for uid, (successful, failed) in list(worker.totals.items()):
                labels = (*worker.escaped, escape_label_value(uid))
                head, tail = template.head.format(*labels), template.tail.format(*labels)
                if successful:
                    out.append(f"{head}successful{tail}{_number(successful)}\n")
                if failed:
                    out.append(f"{head}failed{tail}{_number(failed)}\n")

    def _histogram(
        self, out: list[str], family: Family, labels: tuple[str, ...], histogram: HistogramSeries
    ) -> None:
        bucket, count, total = (self._templates[shape] for shape in family.shapes)
        head, tail = bucket.head.format(*labels), bucket.tail.format(*labels)
        cumulative = 0
        for le, observed in zip(LE_VALUES, histogram.counts[:], strict=True):
            cumulative += observed
            # _number inlined: this is most of an exposition's lines.
            text = f"{cumulative}.0" if cumulative < 1_000_000 else go_float(cumulative)
            out.append(f"{head}{le}{tail}{text}\n")
        out.append(count.line.format(*labels, _number(cumulative)))
        out.append(total.line.format(*labels, go_float(histogram.total)))


# Workers (or containers) rendered per piece: about 1 to 2 ms of work and 200 KB of text for
# the duration histograms, the largest family (bench/metrics_scrape.py).
RENDER_BATCH = 100
_MARK = re.compile("\ue000([0-9]+)\ue001")


def _template(
    encoder: Callable[[Collector], bytes], family: Family, shape: Shape
) -> _Template | None:
    """How ``encoder`` writes a ``shape`` sample; None when its line is not made of the pieces
    expected: the labels in some order, each value once, then the value."""
    last = len(shape.labels) - 1
    marks = [f"\ue000{index}\ue001" for index in range(len(shape.labels))]
    metric = Metric(family.name, family.documentation, family.type)
    metric.samples.append(Sample(shape.name, dict(zip(shape.labels, marks, strict=True)), 0.0))
    text = encoder(_Families([metric])).decode()
    found = [line for line in text.split("\n") if "\ue000" in line]
    if len(found) != 1 or not found[0].endswith(" 0.0"):
        return None
    prefix = found[0].removesuffix("0.0")
    if sorted(int(index) for index in _MARK.findall(prefix)) != list(range(len(marks))):
        return None
    # Literal braces doubled, placeholders made format fields.
    braced = _MARK.sub(r"{\1}", prefix.replace("{", "{{").replace("}", "}}"))
    head, _, tail = braced.partition(f"{{{last}}}")
    return _Template(line=f"{braced}{{{last + 1}}}\n", head=head, tail=tail)


__all__ = ["CONTENT_TYPE", "RENDER_BATCH", "Renderer", "negotiate"]
