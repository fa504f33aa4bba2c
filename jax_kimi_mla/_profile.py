"""Timing a jitted step: wall clock per call, and device time per call from a profiler trace.

Both take the step, its flat argument list and its donation map (see ``_workloads.run``): every
call feeds the donated outputs back in, so the cache is updated in place call after call.

Device time comes from a ``jax.profiler`` trace: the kernels (and memcpys/memsets) on the stream
lines of the GPU's device plane, summed per call. Lines that only aggregate other events ("XLA
Ops", "XLA Modules", "Steps", ...) are skipped, so no kernel is counted twice. Without a device
plane (the CPU backend) there is no device time: ``device_time_per_call`` returns None.

A call's span, from its first kernel's start to its last kernel's end, is reported beside the sum:
it counts the gaps between a call's kernels, and counts once the time that two kernels overlap
(a dependent launch that starts before the kernel it waits for has ended).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax

from ._workloads import run

DEVICE_PLANE_PREFIX = "/device:GPU:"
# Derived lines of a device plane: each of their events spans kernels of the stream lines.
AGGREGATE_LINES = frozenset({
    "XLA Modules", "XLA Ops", "Async XLA Ops", "XLA TraceMe", "Steps", "Launch Stats", "Source code",
    "Framework Name Scope", "Framework Ops", "TensorFlow Name Scope", "TensorFlow Ops",
})


@dataclass(frozen=True)
class DeviceTime:
    seconds: float  # median over calls of the summed kernel durations of one call
    kernels: float  # device events (kernels, memcpys, memsets) per call
    calls: int
    per_call: bool  # False: events could not be split into calls; seconds is then the mean
    span_seconds: float | None = None  # median over calls of first start to last end; None if not per_call


def wall_time_per_call(step: Callable, args: list, donated: dict[int, int], calls: int, warmup: int = 2) -> float:
    """Median wall-clock seconds of one call, each call waited for (``block_until_ready``)."""
    for _ in range(warmup):
        jax.block_until_ready(run(step, args, donated))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(run(step, args, donated))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def device_time_per_call(step: Callable, args: list, donated: dict[int, int], calls: int) -> DeviceTime | None:
    """Device time per call from a profiler trace of ``calls`` back-to-back calls.

    The step must be warmed up (compiled) already. Returns None when the trace has no GPU
    device plane (CPU backend) or no device events in it (the plane and line names it saw are
    printed then, to adapt ``AGGREGATE_LINES``).
    """
    data = _trace(step, args, donated, calls)
    return None if data is None else _device_time(data, calls)


def kernel_durations(step: Callable, args: list, donated: dict[int, int], calls: int) -> dict[str, list[float]]:
    """Each device event's seconds, by name, over ``calls`` back-to-back calls in one trace (the
    step warmed up already); empty without a device plane."""
    data = _trace(step, args, donated, calls)
    durations: dict[str, list[float]] = {}
    for plane in data.planes if data is not None else ():
        if plane.name.startswith(DEVICE_PLANE_PREFIX):
            for e in _stream_events(plane):
                durations.setdefault(e.name, []).append(e.duration_ns * 1e-9)
    return durations


def _trace(step: Callable, args: list, donated: dict[int, int], calls: int):
    """The profiler's data of ``calls`` back-to-back calls, or None (and why, printed)."""
    jax.block_until_ready(args)  # nothing from before may run inside the trace
    with tempfile.TemporaryDirectory(prefix="jax_kimi_mla_trace_") as trace_dir:
        try:
            options = jax.profiler.ProfileOptions()
            # Kernels come from the device tracer; tracing every Python call would only slow
            # the loop and bloat the trace.
            options.python_tracer_level = 0
            options.host_tracer_level = 1
            jax.profiler.start_trace(trace_dir, profiler_options=options)
        except Exception as e:  # no profiler here: timing falls back to the wall clock
            print(f"[profile] cannot start a trace ({type(e).__name__}: {e})")
            return None
        try:
            for _ in range(calls):
                outputs = run(step, args, donated)
            jax.block_until_ready(outputs)
        finally:
            jax.profiler.stop_trace()
        traces = sorted(Path(trace_dir).rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
        if not traces:
            print(f"[profile] no .xplane.pb written under {trace_dir}")
            return None
        try:
            return jax.profiler.ProfileData.from_file(str(traces[-1]))
        except Exception as e:
            print(f"[profile] cannot read {traces[-1].name} ({type(e).__name__}: {e})")
            return None


def _device_time(data, calls: int) -> DeviceTime | None:
    planes = [p for p in data.planes if p.name.startswith(DEVICE_PLANE_PREFIX)]
    if not planes:
        return None
    events = max((_device_events(p) for p in planes), key=len)
    if not events:
        print("[profile] no device events found; planes and lines in the trace:")
        for plane in data.planes:
            print(f"  {plane.name!r}: {[line.name for line in plane.lines]}")
        return None
    events.sort()
    if len(events) % calls:
        # Some call's events are missing or extra ones came along: only a mean is meaningful.
        return DeviceTime(sum(d for _, d in events) * 1e-9 / calls, len(events) / calls, calls, False)
    per = len(events) // calls
    groups = [events[i : i + per] for i in range(0, len(events), per)]
    sums = [sum(d for _, d in g) for g in groups]
    spans = [max(t + d for t, d in g) - g[0][0] for g in groups]
    return DeviceTime(statistics.median(sums) * 1e-9, per, calls, True, statistics.median(spans) * 1e-9)


def _device_events(plane) -> list[tuple[float, float]]:
    """(start_ns, duration_ns) of the events on the stream lines of a device plane."""
    return [(e.start_ns, e.duration_ns) for e in _stream_events(plane)]


def _stream_events(plane) -> list:
    """The events on the stream lines of a device plane (zero-length ones are markers, not work)."""
    lines = list(plane.lines)
    streams = [line for line in lines if line.name.startswith("Stream")]
    if not streams:  # unknown naming: take every line that is not a known aggregate
        streams = [line for line in lines if line.name not in AGGREGATE_LINES]
    return [e for line in streams for e in line.events if e.duration_ns > 0]
