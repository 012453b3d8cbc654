"""Where a training step's time goes, measured: ``cli_bench.py --profile`` (issue 41).

Two instruments, both in every process of a run (each rank writes its own numbers):

- **Timers** on the timed steps, cheap enough not to change them. Host clocks around what runs between one
  step's end and the next step's start (Trainer's ``get_batch_samples``: the ``next()`` on the data loader,
  i.e. waiting for the workers and the host-to-device copy, then counting the loss's items, which under DDP
  gathers a number from every rank; ``_maybe_log_save_evaluate``: logging), and CUDA events at Trainer's own
  hooks inside the step (forward + backward + gradient clipping, the optimizer step, scheduler and
  ``zero_grad``), plus host clock and CUDA events around the package's mask building (``prepare_attention``,
  called once per batch outside the compiled graph).
- **torch.profiler** on a few extra steps after the timed ones: from the GPU kernels of those steps, the
  communication (NCCL kernels) that no compute kernel overlaps ("exposed"), and the time the GPU ran nothing.

``summarise`` turns one rank's records into per-step milliseconds; cli_bench prints them beside the run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

# host records: (category, global step at the call, seconds)
HOST = []


def _timed_iterator(iterator, sink: list):
    """``iterator`` with the time spent in each ``next()`` appended to ``sink``."""

    class Timed:
        def __iter__(self):
            return self

        def __next__(self):
            t = time.perf_counter()
            try:
                return next(iterator)
            finally:
                sink.append(time.perf_counter() - t)

    return Timed()


def install_host_timers() -> None:
    """Wrap Trainer's batch fetch and its logging step with host clocks (for every Trainer subclass)."""
    from transformers import Trainer

    fetch, log = Trainer.get_batch_samples, Trainer._maybe_log_save_evaluate
    iterators = []  # each epoch's iterator: its first fetch starts the data loader (and its workers) anew

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        waits, t = [], time.perf_counter()
        out = fetch(self, _timed_iterator(epoch_iterator, waits), num_batches, device)
        total, step = time.perf_counter() - t, self.state.global_step
        HOST.append(("data_wait", step, sum(waits)))
        if not iterators or iterators[-1] is not epoch_iterator:
            iterators[:] = [epoch_iterator]
            HOST.append(("epoch_start", step, sum(waits)))
        HOST.append(("count_items", step, total - sum(waits)))  # labels.ne(-100).sum(), gathered over ranks
        return out

    def maybe_log_save_evaluate(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return log(self, *args, **kwargs)
        finally:
            HOST.append(("log_save_eval", self.state.global_step, time.perf_counter() - t))

    Trainer.get_batch_samples, Trainer._maybe_log_save_evaluate = get_batch_samples, maybe_log_save_evaluate


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def length(intervals) -> float:
    return sum(end - start for start, end in intervals)


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def kernel_times(trace: dict, window_us: float, steps: int) -> dict:
    """Per step (ms): GPU busy, communication (NCCL kernels), communication no compute overlaps, GPU idle."""
    kernels = [e for e in trace.get("traceEvents", [])
               if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    comm = merged([(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e.get("name", "").lower()])
    compute = merged([(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e.get("name", "").lower()])
    busy = length(merged(comm + compute))
    per_step = lambda us: round(us / 1000 / steps, 3)  # noqa: E731
    return {"kernels": len(kernels), "gpu_busy_ms": per_step(busy), "communication_ms": per_step(length(comm)),
            "exposed_communication_ms": per_step(length(comm) - overlap(comm, compute)),
            "gpu_idle_ms": per_step(max(0.0, window_us - busy))}


def profile_callback(warmup_steps: int, timed_steps: int, profile_steps: int, folder: Path):
    import torch
    from transformers import TrainerCallback

    cuda = torch.cuda.is_available()

    class StepProfile(TrainerCallback):
        """CUDA events at the step's hooks, mask building timed, torch.profiler on the steps after the timed ones."""

        def __init__(self):
            self.events, self.step_records, self.mask = {}, [], []
            self.profiler, self.window = None, None

        def _mark(self, name):
            if cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self.events[name] = event
            self.events[name + "_host"] = time.perf_counter()

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            inner = model
            while hasattr(inner, "module"):
                inner = inner.module
            build = getattr(inner, "prepare_attention", None)
            if build is None:
                return
            records = self.mask

            def timed_prepare_attention(*a, **k):
                t, start = time.perf_counter(), None
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                with torch.profiler.record_function("hf_lookaround.prepare_attention"):
                    out = build(*a, **k)
                if cuda:
                    end.record()
                records.append([state.global_step + 1, time.perf_counter() - t, (start, end) if cuda else None])
                return out

            inner.prepare_attention = timed_prepare_attention  # an instance attribute: this run's model only

        def on_step_begin(self, args, state, control, **kwargs):
            self.events = {}
            self._mark("begin")

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self._mark("pre_optimizer")

        def on_optimizer_step(self, args, state, control, **kwargs):
            self._mark("optimizer")

        def on_step_end(self, args, state, control, **kwargs):
            self._mark("end")
            if cuda:
                torch.cuda.synchronize()
            e, step = self.events, state.global_step
            if "pre_optimizer" in e and "optimizer" in e:
                gpu = (lambda a, b: e[a].elapsed_time(e[b])) if cuda else (lambda a, b: None)
                host = lambda a, b: 1000 * (e[b + "_host"] - e[a + "_host"])  # noqa: E731
                self.step_records.append({
                    "step": step,
                    "forward_backward_clip_ms": gpu("begin", "pre_optimizer"),
                    "optimizer_ms": gpu("pre_optimizer", "optimizer"),
                    "scheduler_zero_grad_ms": gpu("optimizer", "end"),
                    "host_forward_backward_clip_ms": host("begin", "pre_optimizer"),
                    "host_optimizer_ms": host("pre_optimizer", "optimizer"),
                })
            last_timed = warmup_steps + timed_steps
            if profile_steps and step == last_timed:
                # kernels only on a GPU: a small trace, quick to write and read
                self.profiler = torch.profiler.profile(activities=[
                    torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU])
                self.profiler.start()
                self.window = time.perf_counter()
            elif self.profiler is not None and step == last_timed + profile_steps:
                window_us = 1e6 * (time.perf_counter() - self.window)
                self.profiler.stop()
                path = folder / f"trace.rank{rank()}.json"
                self.profiler.export_chrome_trace(str(path))
                if cuda:  # kernels only on a GPU (gloo's all-reduce on the CPU is no kernel)
                    self.kernels = kernel_times(json.loads(path.read_text()), window_us, profile_steps)
                    self.kernels["steps"] = profile_steps
                path.unlink()  # tens of MB; the numbers are kept
                self.profiler = None

        def summary(self) -> dict:
            return summarise(self, warmup_steps, timed_steps)

    return StepProfile()


def rank() -> int:
    import os

    return int(os.environ.get("RANK", "0"))


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), 3) if values else None


def summarise(profile, warmup_steps: int, timed_steps: int) -> dict:
    """Per-step means (ms) over the timed steps of one rank."""
    first, last = warmup_steps + 1, warmup_steps + timed_steps
    # a gap after step k (warmup <= k < last) holds the logging of step k and the fetch for step k + 1
    gap = {name: [1000 * s for n, k, s in HOST if n == name and warmup_steps <= k < last]
           for name in ("data_wait", "count_items", "log_save_eval")}
    steps = [r for r in profile.step_records if first <= r["step"] <= last]
    mask = [m for m in profile.mask if first <= m[0] <= last]
    out = {"rank": rank(), "timed_steps": len(steps),
           "gap": {f"{name}_ms": round(sum(v) / max(1, last - warmup_steps), 3) for name, v in gap.items()},
           # a mean over the timed steps can be a few long waits: the median, the longest three and the epochs begun
           "data_wait": {"median_ms": round(sorted(gap["data_wait"])[len(gap["data_wait"]) // 2], 3)
                         if gap["data_wait"] else None,
                         "longest_ms_at_step": sorted(((round(1000 * s, 1), k + 1) for n, k, s in HOST
                                                       if n == "data_wait" and warmup_steps <= k < last),
                                                      reverse=True)[:3],
                         "epoch_starts": sum(1 for n, k, _ in HOST if n == "epoch_start" and warmup_steps <= k < last)},
           "step": {key: _mean(r[key] for r in steps) for key in (steps[0] if steps else {}) if key != "step"},
           "mask_building": {"host_ms": _mean(1000 * m[1] for m in mask) if mask else None,
                             "gpu_ms": _mean(m[2][0].elapsed_time(m[2][1]) for m in mask if m[2]) if mask else None,
                             "calls_per_step": round(len(mask) / max(1, len(steps)), 2)},
           "profiled": getattr(profile, "kernels", None)}
    return out
