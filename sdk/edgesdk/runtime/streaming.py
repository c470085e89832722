"""A stream of frames through a bundle, pipelined: one worker thread per device, frames in flight at once.

Each device (cpu, edgetpu:0, edgetpu:1, ...) gets a worker that runs that device's segments for the
frames in flight. A segment of a frame is ready when the segments producing its inputs (on any device)
for that frame are done; a worker runs its earliest ready task in the order (frame, manifest position).
While edgetpu:1 works on frame f, edgetpu:0 can already run frame f+1, and a CPU holding the first and
the last segment runs frame f+1's first while frame f's last waits for the TPUs: the throughput is that
of the busiest device, as the schedule's simulator predicts, not the sum of all segments.

No deadlock: a task depends only on tasks before it in that order, so the earliest unfinished task is
ready, and its worker, when idle, takes it.

Replicas (data parallelism): the plan may come with replicas, each the same segments with the
accelerators swapped (edgetpu:0's work on edgetpu:1 and back); frame f runs plan f mod (1 + replicas),
so two Edge TPUs each holding the whole model take alternate frames, and results still come out in
input order.

Bounded: at most `depth` frames are in flight (fed and not yet yielded); the caller's iterator is
read only as results are taken. Results come out in input order.

Errors: a segment that raises marks its frame failed; the frame's other segments are skipped (they
are ready at once, so no worker waits on them), and the error is raised to the caller when that
frame's turn comes. A frame that the caller's iterator raises for (a malformed input refused by the
model's checks) is raised after every frame before it has been yielded. An error in a worker's own
loop (not a segment's) ends that worker: the caller never waits on a dead worker; its next wait for a
frame not yet done raises that error instead. Closing the generator (or an error) stops the workers
and joins them.

Frames are compared by identity only: a task is taken from its queue by position, and `_Frame` has no
value equality (its arrays have no truth value, so `==` on two frames raises).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import numpy as np

# never by value: a frame's env holds arrays, and == on arrays has no truth value
@dataclass(eq=False)
class _Frame:
    env: dict
    done: dict[str, threading.Event]          # segment id -> finished (or skipped)
    plan: int = 0                             # which of the plans (replicas) it runs
    error: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


# How long the caller waits on the workers before it looks again whether each is still alive (a worker
# that ends records why and wakes the caller; this bounds the wait should that ever be missed).
LIVENESS_POLL_S = 1.0


def _take(queue: list, ready: Callable) -> tuple | None:
    """The earliest ready task of a device's queue, removed by its position (never by comparing tasks)."""
    for i, task in enumerate(queue):
        if ready(task[0], task[1]):
            return queue.pop(i)
    return None


def stream(runners: list, feeds_of: Callable, call: Callable, outputs: Callable,
           frames: Iterable[dict[str, np.ndarray]], depth: int, replicas: list | None = None
           ) -> Iterator[dict[str, np.ndarray]]:
    """`runners`: (segment, runner) in manifest order; `replicas`: more such lists, frames dealt in turn
    over all of them. `feeds_of(segment, runner, env)` picks a segment's inputs, `call(runner, feeds)`
    runs it, `outputs(env)` makes a frame's result."""
    if depth < 1:
        raise ValueError(f"depth must be at least 1, got {depth}")
    plans = [runners, *(replicas or [])]
    waits = []   # per plan: segment id -> the segments of the same frame it waits for
    for plan in plans:
        producer = {t.name: seg.id for seg, _ in plan for t in seg.outputs}
        waits.append({seg.id: sorted({producer[t.name] for t in seg.inputs if t.name in producer}) for seg, _ in plan})
    devices = list(dict.fromkeys(seg.device for plan in plans for seg, _ in plan))
    pending: dict[str, list] = {d: [] for d in devices}   # (frame, segment, runner), in global order
    cond = threading.Condition()
    stopping = False
    failed: list[BaseException] = []   # a worker's own error (not a segment's): the stream cannot go on

    def ready(frame: _Frame, seg) -> bool:
        return frame.error is not None or all(frame.done[sid].is_set() for sid in waits[frame.plan][seg.id])

    def work(device: str) -> None:
        while True:
            with cond:
                while True:
                    if stopping:
                        return
                    task = _take(pending[device], ready)
                    if task is not None:
                        break
                    cond.wait()
            frame, seg, runner = task
            if frame.error is None:
                try:
                    with frame.lock:
                        feeds = feeds_of(seg, runner, frame.env)
                    result = call(runner, feeds)
                    with frame.lock:
                        frame.env.update(result)
                except BaseException as e:  # noqa: BLE001 -- handed to the caller with its frame
                    frame.error = frame.error or e
            with cond:
                frame.done[seg.id].set()
                cond.notify_all()

    def worker(device: str) -> None:
        try:
            work(device)
        except BaseException as e:  # noqa: BLE001 -- raised to the caller by its next wait
            with cond:
                failed.append(e)
                cond.notify_all()

    def wait_for(frame: _Frame) -> None:
        """Until every segment of `frame` is done; a worker's failure is raised instead."""
        with cond:
            while not all(event.is_set() for event in frame.done.values()):
                if failed:
                    raise failed[0]
                if not all(w.is_alive() for w in workers):
                    raise RuntimeError("a worker of the stream ended before the frame it owed was done")
                cond.wait(LIVENESS_POLL_S)

    workers: list[threading.Thread] = []
    in_flight: list[_Frame] = []
    try:
        for d in devices:
            workers.append(threading.Thread(target=worker, args=(d,), name=f"edgesdk-stream-{d}", daemon=True))
            workers[-1].start()
        source = iter(frames)
        exhausted, fed = False, 0
        refused: BaseException | None = None  # a frame the caller's iterator could not give (a bad input)
        while True:
            while not exhausted and len(in_flight) < depth:
                try:
                    feeds = next(source)
                except StopIteration:
                    exhausted = True
                    break
                except Exception as e:  # noqa: BLE001 -- raised after the good frames before it are yielded
                    refused, exhausted = e, True
                    break
                which = fed % len(plans)
                fed += 1
                frame = _Frame({name: np.asarray(v) for name, v in feeds.items()},
                               {seg.id: threading.Event() for seg, _ in plans[which]}, which)
                in_flight.append(frame)
                with cond:
                    for seg, runner in plans[which]:
                        pending[seg.device].append((frame, seg, runner))
                    cond.notify_all()
            if not in_flight:
                if refused is not None:
                    raise refused
                return
            frame = in_flight.pop(0)
            wait_for(frame)
            if frame.error is not None:
                raise frame.error
            yield outputs(frame.env)
    finally:
        # stop: tasks not started are dropped, a running segment finishes, then the workers exit
        with cond:
            stopping = True
            cond.notify_all()
        for w in workers:
            if w.ident is not None:   # started
                w.join()
