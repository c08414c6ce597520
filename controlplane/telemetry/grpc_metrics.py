"""gRPC server metrics under the conventional names and labels.

The names, labels and meanings are go-grpc-prometheus's (also
py-grpc-prometheus's and java-grpc-prometheus's), so dashboards and alert
rules written for those work unchanged:

- ``grpc_server_started_total{grpc_type,grpc_service,grpc_method}``
- ``grpc_server_handled_total{grpc_type,grpc_service,grpc_method,grpc_code}``
- ``grpc_server_handling_seconds{grpc_type,grpc_service,grpc_method}`` (histogram)
- ``grpc_server_msg_received_total`` / ``grpc_server_msg_sent_total``

``grpc_code`` is spelled as Go spells status codes (``OK``,
``InvalidArgument``, ``Unavailable``, ``Canceled``), the values those
dashboards and the usual "gRPC errors" alerts match on.

The interceptor (controlplane/rpc/calltiming.py) bumps plain ints in ``RpcStats``
on the event-loop thread; ``RpcCollector`` turns them into families at scrape
time. For unary RPCs one message each way is implied by the call, so the
message counters are derived at scrape time (received = started, sent =
handled with ``OK``) instead of being counted per call; streams count theirs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

import grpc
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane.telemetry.histogram import RPC_BUCKETS_S, LatencyHistogram

UNARY, CLIENT_STREAM, SERVER_STREAM, BIDI_STREAM = (
    "unary", "client_stream", "server_stream", "bidi_stream",
)  # fmt: skip

Method = tuple[str, str]  # (service, method)


def grpc_type(request_streaming: bool, response_streaming: bool) -> str:
    if request_streaming:
        return BIDI_STREAM if response_streaming else CLIENT_STREAM
    return SERVER_STREAM if response_streaming else UNARY


def _go_name(code: grpc.StatusCode) -> str:
    special = {"OK": "OK", "CANCELLED": "Canceled"}  # Go's codes.Code.String()
    name = str(code.name)
    return special.get(name, "".join(part.capitalize() for part in name.split("_")))


# StatusCode.name (how the interceptor and the access logs name a code) ->
# the grpc_code label value.
GRPC_CODE: dict[str, str] = {sc.name: _go_name(sc) for sc in grpc.StatusCode}


class RpcStats:
    """Per-RPC counters the server interceptor bumps (plain dict entries)."""

    def __init__(self) -> None:
        # (service, method, status code name) -> calls completed
        self.handled: Counter[tuple[str, str, str]] = Counter()
        # (service, method) -> calls started
        self.started: Counter[Method] = Counter()
        # (service, method) -> stream messages (streaming RPCs only)
        self.msg_received: Counter[Method] = Counter()
        self.msg_sent: Counter[Method] = Counter()
        # (service, method) -> grpc_type, set when the interceptor first sees it
        self.types: dict[Method, str] = {}
        # (service, method) -> time from the handler's start to its end
        self.handling: dict[Method, LatencyHistogram] = {}
        # method -> latency of admission decisions (Admit per call,
        # AdmitStream per batch), measured inside the server.
        self.decision_latency: dict[str, LatencyHistogram] = {}
        # reason (missing, invalid, forbidden) -> refused calls
        self.auth_failures: Counter[str] = Counter()
        # (service, method) -> [calls started, calls answered OK] of the
        # admission unary calls, counted apart from ``started`` and
        # ``handled`` (a list's item costs less to bump than a Counter's);
        # read through :meth:`counts`.
        self._unary: dict[Method, list[int]] = {}

    def unary_calls(self, service: str, method: str) -> list[int]:
        """The [started, OK] cell of ``service/method`` (made once)."""
        key = (service, method)
        cell = self._unary.get(key)
        if cell is None:
            cell = self._unary[key] = [0, 0]
        return cell

    def counts(self) -> tuple[Counter[Method], Counter[tuple[str, str, str]]]:
        """Calls started and calls handled by code, every count included."""
        started = self.started.copy()
        handled = self.handled.copy()
        for (service, method), (n_started, n_ok) in list(self._unary.items()):
            started[(service, method)] += n_started
            handled[(service, method, "OK")] += n_ok
        return +started, +handled

    def method(self, service: str, method: str, kind: str) -> LatencyHistogram:
        """Register ``service/method`` as an RPC of ``kind`` (a grpc_type);
        returns its handling-time histogram."""
        key = (service, method)
        self.types.setdefault(key, kind)
        h = self.handling.get(key)
        if h is None:
            h = self.handling[key] = LatencyHistogram(RPC_BUCKETS_S)
        return h

    def histogram(self, method: str) -> LatencyHistogram:
        h = self.decision_latency.get(method)
        if h is None:
            h = self.decision_latency[method] = LatencyHistogram()
        return h


class RpcCollector(Collector):
    def __init__(self, stats: RpcStats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        st = self._stats
        types = st.types.copy()
        labels = ["grpc_type", "grpc_service", "grpc_method"]

        def kind(key: Method) -> str:
            return types.get(key, UNARY)

        started = CounterMetricFamily(
            "grpc_server_started_total", "RPCs started on the server", labels=labels
        )
        started_counts, handled_counts = st.counts()
        started_now = sorted(started_counts.items())
        for (service, method), n in started_now:
            started.add_metric([kind((service, method)), service, method], n)
        yield started
        handled = CounterMetricFamily(
            "grpc_server_handled_total",
            "RPCs completed on the server, regardless of success or failure",
            labels=[*labels, "grpc_code"],
        )
        handled_now = sorted(handled_counts.items())
        for (service, method, code), n in handled_now:
            handled.add_metric(
                [kind((service, method)), service, method, GRPC_CODE.get(code, code)], n
            )
        yield handled
        handling = HistogramMetricFamily(
            "grpc_server_handling_seconds",
            "Time from the start of an RPC's handler to its end (a stream: its whole life)",
            labels=labels,
        )
        for (service, method), hist in sorted(st.handling.copy().items()):
            buckets, total = hist.buckets()
            handling.add_metric([kind((service, method)), service, method], buckets, total)
        yield handling
        yield from self._messages(started_now, handled_now, kind)
        latency = HistogramMetricFamily(
            "burstgate_decision_duration_seconds",
            "Server-side time to decide: Admit per call, AdmitStream per batch",
            labels=["method"],
        )
        for method, hist in sorted(st.decision_latency.copy().items()):
            buckets, total = hist.buckets()
            latency.add_metric([method], buckets, total)
        yield latency
        failures = CounterMetricFamily(
            "burstgate_auth_failures",
            "Calls refused by authentication or authorization",
            labels=["reason"],
        )
        for reason, n in sorted(st.auth_failures.copy().items()):
            failures.add_metric([reason], n)
        yield failures

    def _messages(
        self,
        started_now: list[tuple[Method, int]],
        handled_now: list[tuple[tuple[str, str, str], int]],
        kind: Callable[[Method], str],
    ) -> Iterator[Metric]:
        st = self._stats
        labels = ["grpc_type", "grpc_service", "grpc_method"]
        received: Counter[Method] = Counter()
        sent: Counter[Method] = Counter()
        # Unary and server-streaming calls receive their one request with the
        # call; unary calls send their one response when they end OK.
        for key, n in started_now:
            if kind(key) in (UNARY, SERVER_STREAM):
                received[key] += n
        for (service, method, code), n in handled_now:
            if code == "OK" and kind((service, method)) in (UNARY, CLIENT_STREAM):
                sent[(service, method)] += n
        received.update(st.msg_received.copy())
        sent.update(st.msg_sent.copy())
        for name, counts, what in (
            ("grpc_server_msg_received_total", received, "RPC messages received on the server"),
            ("grpc_server_msg_sent_total", sent, "RPC messages sent by the server"),
        ):
            family = CounterMetricFamily(name, what, labels=labels)
            for (service, method), n in sorted(counts.items()):
                family.add_metric([kind((service, method)), service, method], n)
            yield family
