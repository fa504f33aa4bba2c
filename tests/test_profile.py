"""Device time from a profiler trace (jax_kimi_mla._profile), on a hand-made trace: the per-call sum of
kernel durations and the per-call span, with aggregate lines left out."""

from dataclasses import dataclass, field

from pytest import approx

from jax_kimi_mla import _profile


@dataclass
class Event:
    name: str
    start_ns: float
    duration_ns: float


@dataclass
class Line:
    name: str
    events: list = field(default_factory=list)


@dataclass
class Plane:
    name: str
    lines: list


@dataclass
class Trace:
    planes: list


def trace(calls: list[list[tuple[float, float]]]) -> Trace:
    """A GPU plane whose stream line holds each call's (start, duration) kernels, and an aggregate
    line with one event over each call (which must not be counted)."""
    stream = Line("Stream #7(compute)")
    ops = Line("XLA Ops")
    for kernels in calls:
        stream.events += [Event(f"k{i}", start, duration) for i, (start, duration) in enumerate(kernels)]
        first, last = kernels[0][0], max(s + d for s, d in kernels)
        ops.events.append(Event("call", first, last - first))
    stream.events.append(Event("marker", 0.0, 0.0))  # zero-length: not work
    return Trace([Plane("/host:CPU", [Line("python", [Event("x", 0.0, 5.0)])]), Plane("/device:GPU:0", [ops, stream])])


def test_sum_and_span_per_call():
    # Call 1: 7 + 3 us with a 1 us gap (span 11). Call 2: the second kernel starts before the first
    # ends, as a dependent launch does (sum 11, span 10). Call 3: back to back (sum = span = 10).
    calls = [[(0, 7000), (8000, 3000)], [(20000, 7000), (26000, 4000)], [(40000, 6000), (46000, 4000)]]
    t = _profile._device_time(trace(calls), len(calls))
    assert t.per_call and t.calls == 3 and t.kernels == 2
    assert t.seconds == approx(10e-6)  # median of 10, 11, 10 us
    assert t.span_seconds == approx(10e-6)  # median of 11, 10, 10 us
    # The second call alone: the overlap counts once in the span, twice in the sum.
    alone = _profile._device_time(trace(calls[1:2]), 1)
    assert (alone.seconds, alone.span_seconds) == (approx(11e-6), approx(10e-6))


def test_calls_that_cannot_be_told_apart_give_a_mean_and_no_span():
    t = _profile._device_time(trace([[(0, 4000), (5000, 2000)], [(9000, 3000)]]), 2)
    assert not t.per_call and t.span_seconds is None
    assert t.seconds == approx(4.5e-6) and t.kernels == 1.5


def test_no_device_plane_means_no_device_time():
    assert _profile._device_time(Trace([Plane("/host:CPU", [Line("python", [Event("x", 0.0, 5.0)])])]), 1) is None
