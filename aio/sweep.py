"""aio-sweep: measure a drive across aio settings and print the best ``aio`` block.

    aio-sweep /local_nvme                    # smart search, about a minute or two
    aio-sweep /local_nvme --exhaustive       # every combination of the space
    aio-sweep /nvme0 /nvme1 --json trials.json --plot sweep.png

Runs in-process: one AsyncIOHandle per directory and configuration, O_DIRECT,
one file per directory preallocated once and reused, removed at the end (also
on Ctrl-C). The smart search measures block_size x queue_depth x
single_submit first, then threads, overlap_events and engines around the
four best, then the six leaders head to head in paired rounds; it visits
about a fifth of the full grid.

With several directories (one per drive) the search measures them together,
each drive with its own handle and queue, and then, at the chosen settings,
each drive alone and the set together: what the set gives over one drive.
"""

from __future__ import annotations

import argparse
import errno
import itertools
import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ._cli import (
    CliError,
    CliParser,
    check_directory,
    check_interrupt,
    check_memory,
    int_in,
    open_scratch,
    parse_size,
    remove_scratch,
    run_cli,
    scratch_buffer,
    signals_deferred,
)
from .handle import AsyncIOHandle

# The engines a sweep can measure, as short() shows them.
ENGINE_TAGS = {"kernel_aio": "kaio", "io_uring": "uring"}


@dataclass(frozen=True, order=True)
class Setting:
    """One combination of handle settings to measure."""

    block_size: int
    queue_depth: int
    thread_count: int
    single_submit: bool
    overlap_events: bool
    engine: str = "kernel_aio"

    def aio_block(self) -> dict[str, Any]:
        """Keys read by both aio.config and DeepSpeed 0.19 (real booleans), and
        ``engine``, which aio.config reads and DeepSpeed ignores."""
        return {
            "block_size": self.block_size,
            "queue_depth": self.queue_depth,
            "intra_op_parallelism": self.thread_count,
            "single_submit": self.single_submit,
            "overlap_events": self.overlap_events,
            "engine": self.engine,
        }

    def short(self) -> str:
        """A fixed-width one-line description for progress and tables."""
        bs = self.block_size
        b = f"{bs >> 20}M" if bs % (1 << 20) == 0 else f"{bs >> 10}K"
        return (
            f"bs={b:>4s} qd={self.queue_depth:<3d} t={self.thread_count} "
            f"ss={int(self.single_submit)} ov={int(self.overlap_events)} {ENGINE_TAGS[self.engine]}"
        )


@dataclass
class Space:
    """The values to try for each setting; the grid is their product."""

    block_sizes: list[int]
    queue_depths: list[int]
    threads: list[int]
    single_submit: list[bool]
    overlap_events: list[bool]
    engines: list[str] = field(default_factory=lambda: ["kernel_aio"])

    def all(self) -> list[Setting]:
        """Every setting of the grid."""
        return [
            Setting(*c)
            for c in itertools.product(
                self.block_sizes,
                self.queue_depths,
                self.threads,
                self.single_submit,
                self.overlap_events,
                self.engines,
            )
        ]

    def size(self) -> int:
        """Number of settings in the grid."""
        return (
            len(self.block_sizes)
            * len(self.queue_depths)
            * len(self.threads)
            * len(self.single_submit)
            * len(self.overlap_events)
            * len(self.engines)
        )


@dataclass
class Trial:
    """One timed transfer: its setting, direction, rate, time, bytes and search stage."""

    setting: Setting
    direction: str
    gbps: float
    seconds: float
    nbytes: int
    stage: str


class SweepError(CliError):
    """A problem found before any I/O (bad directory, no space, no O_DIRECT)."""


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, fitted to its
    width; a line every 5 s otherwise. A sweep runs in stages whose trial
    counts are known only when each begins (:meth:`begin`): the bar counts
    the current stage's trials and names it ("refine, stage 2 of 3")."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.total = total
        self.done = 0
        self.label = ""
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.t0 = time.monotonic()
        self._last_line = 0.0

    def begin(self, label: str, total: int) -> None:
        """Start a stage of `total` trials named `label`."""
        if self.done and self.tty and not self.quiet:
            sys.stderr.write("\n")  # the finished stage's line stays on screen
        self.label, self.total, self.done = label, total, 0

    def step(self, note: str) -> None:
        """Count one finished trial and show it with `note`."""
        self.done += 1
        if self.quiet:
            return
        frac = min(1.0, self.done / max(self.total, 1))
        bar = "#" * int(frac * 20)
        took = time.monotonic() - self.t0
        label = f"{self.label}: " if self.label else ""
        line = f"{label}[{bar:<20s}] {self.done}/{self.total} trials {took:4.0f}s  {note}".rstrip()
        now = time.monotonic()
        if self.tty:
            # One column short of the width: writing the last column wraps on
            # some terminals, and a wrapped line is never redrawn in place.
            width = max(20, shutil.get_terminal_size((80, 24)).columns - 1)
            sys.stderr.write("\r" + line[:width] + "\x1b[K")
            sys.stderr.flush()
        elif now - self._last_line > 5 or self.done == self.total:
            sys.stderr.write(line + "\n")
            self._last_line = now

    def close(self) -> None:
        """End the bar's line on a terminal."""
        if self.tty and not self.quiet and self.done:
            sys.stderr.write("\n")
            self.done = 0


class Drive:
    """The files the sweep reads and writes: one per directory, preallocated.

    Each is a fresh mkstemp file (unpredictable name, O_EXCL|O_NOFOLLOW, 0600)
    used only through its descriptor, so nothing another user plants in the
    directory is ever opened or written. Each directory has its own slice of
    one locked buffer, and each trial gives each directory its own handle.
    """

    def __init__(self, dirs: Sequence[str], io_size: int, allow_buffered: bool) -> None:
        self.dirs = [os.path.abspath(d) for d in dirs]
        self.io_size = io_size
        self.allow_buffered = allow_buffered
        self.paths: list[str] = []
        self.fds: list[int] = []
        self.direct: list[bool] = []  # per directory, from the O_DIRECT probe
        self.memory: list[bool] = []  # per directory: on a filesystem in memory (tmpfs)
        self.buffered = False  # some directory has no O_DIRECT
        self.locked = True
        self.buf: Any = None
        self.bufs: list[Any] = []  # one io_size slice of buf per directory

    def check(self) -> None:
        """Every check that can fail before any I/O; nothing is written until
        every directory has passed the path and space checks."""
        self._check_paths()
        self.direct, self.memory = [], []
        for d in self.dirs:
            try:
                with signals_deferred():
                    fd, probe, direct = open_scratch(d, ".aio-sweep-probe-")
                    remove_scratch(fd, probe)
            except CliError as e:
                raise SweepError(str(e)) from None
            # tmpfs takes O_DIRECT since Linux 6.6: the probe passes, yet every
            # "read" is a memory copy (4 GB/s read here, and a best block).
            kind = fs_type(d)
            self.direct.append(direct)
            self.memory.append(kind in MEMORY_FILESYSTEMS)
            if not direct or self.memory[-1]:
                if not self.allow_buffered:
                    raise SweepError(_not_a_drive(d, kind, direct))
                self.buffered = True
        try:
            check_memory(self.io_size * len(self.dirs), "--io-size")
        except CliError as e:
            raise SweepError(str(e)) from None

    def _check_paths(self) -> None:
        """Each directory exists, is writable and has room for its file; no
        directory is given twice; directories sharing a filesystem have room
        for all of their files."""
        seen: dict[str, str] = {}
        for d in self.dirs:
            try:
                check_directory(d, self.io_size, "--io-size")
            except CliError as e:
                raise SweepError(str(e)) from None
            real = os.path.realpath(d)
            if real in seen:
                raise SweepError(f"{d}: given twice (also as {seen[real]}); give one directory per drive")
            seen[real] = d
        for group in same_filesystem(self.dirs):
            if len(group) > 1:
                try:
                    check_directory(group[0], self.io_size * len(group), "--io-size")
                except CliError as e:
                    raise SweepError(f"{e} (one file for each of {', '.join(group)})") from None

    def prepare(self, log: Any = print) -> None:
        """Allocate the I/O buffer and create, preallocate and fill one scratch file per directory."""
        n = self.io_size
        self.buf, self.locked = scratch_buffer(n * len(self.dirs), log)
        self.buf.random_(0, 256)
        self.bufs = [self.buf[i * n : (i + 1) * n] for i in range(len(self.dirs))]
        direct = self.direct or [not self.buffered] * len(self.dirs)
        h = AsyncIOHandle(block_size=1 << 20, queue_depth=16)
        try:
            for d, buf, dio in zip(self.dirs, self.bufs, direct, strict=True):
                try:
                    with signals_deferred():  # the file is in self.paths before a Ctrl-C lands
                        fd, p, _ = open_scratch(d, "aio-sweep-", direct=dio)
                        self.fds.append(fd)
                        self.paths.append(p)
                except CliError as e:
                    raise SweepError(str(e)) from None
                # Allocate the whole file once: writing into new blocks is much
                # slower than overwriting and would skew the write trials.
                try:
                    os.posix_fallocate(fd, 0, self.io_size)
                except OSError as e:
                    if e.errno == errno.ENOSPC:
                        raise SweepError(f"{d}: no space left for {self.io_size} bytes") from None
                h.sync_pwrite(buf, fd)
        finally:
            h.close()

    def run(self, s: Setting, direction: str, which: Sequence[int] | None = None) -> float:
        """Seconds to move io_size bytes per directory with setting `s`: the
        directories `which` (default all), each with its own handle, all
        submitted at once; the time is the wall time until the last is done."""
        idx = list(range(len(self.fds))) if which is None else list(which)
        handles: list[AsyncIOHandle] = []
        try:
            for _ in idx:
                handles.append(
                    AsyncIOHandle(
                        block_size=s.block_size,
                        queue_depth=s.queue_depth,
                        thread_count=s.thread_count,
                        single_submit=s.single_submit,
                        overlap_events=s.overlap_events,
                        engine=s.engine,
                    )
                )
            t0 = time.perf_counter()
            futs = [
                (h.async_pread if direction == "read" else h.async_pwrite)(self.bufs[i], self.fds[i])
                for h, i in zip(handles, idx, strict=True)
            ]  # drives run concurrently
            for f in futs:
                f.result()
            return time.perf_counter() - t0
        finally:
            for h in handles:
                h.close()  # waits for in-flight I/O, so the descriptors can be closed after

    def cleanup(self) -> None:
        """Close and remove the scratch files."""
        for fd, p in zip(self.fds, self.paths, strict=True):
            remove_scratch(fd, p)
        self.fds = []
        self.paths = []


def same_filesystem(dirs: Sequence[str]) -> list[list[str]]:
    """`dirs` grouped by filesystem (``os.stat().st_dev``), in the order given."""
    groups: dict[int, list[str]] = {}
    for d in dirs:
        groups.setdefault(os.stat(d).st_dev, []).append(d)
    return list(groups.values())


# Filesystems in memory: what a sweep there measures is memory copies.
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


def _not_a_drive(d: str, kind: str, direct: bool) -> str:
    """Why Drive.check refuses directory `d` without --allow-buffered."""
    if kind in MEMORY_FILESYSTEMS:
        why = f"{d} is on {kind}, in memory, so results would measure memory copies, not a drive"
    else:
        why = (
            f"{d}: the filesystem does not support O_DIRECT, so results would measure the page "
            "cache, not the drive"
        )
    return f"{why}. Use a directory on the drive itself, or pass --allow-buffered to sweep it anyway"


def fs_type(path: str) -> str:
    """The filesystem type of the mount holding `path` ('' when unknown)."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mounts") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[1])
        inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best):
            best, kind = mnt, parts[2]
    return kind


def disk_of(dev: int) -> str | None:
    """The whole block device (``nvme0n1``) behind a filesystem's ``st_dev``,
    from sysfs; None when there is none (tmpfs, overlay, network)."""
    node = os.path.realpath(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not os.path.isdir(node):
        return None
    if os.path.exists(os.path.join(node, "partition")):
        node = os.path.dirname(node)
    return os.path.basename(node)


def device_notes(drive: Drive) -> list[str]:
    """Why a set of directories cannot beat one drive: two on one filesystem
    (same ``st_dev``), two filesystems on one disk, or a directory without
    O_DIRECT (tmpfs and the like measure memory, not a drive)."""
    notes = []
    groups = same_filesystem(drive.dirs)
    for g in groups:
        if len(g) > 1:
            dev = os.stat(g[0]).st_dev
            notes.append(
                f"{' and '.join(g)} are on the same device (st_dev {os.major(dev)}:{os.minor(dev)}): "
                "they share one drive, so the set cannot beat one drive"
            )
    disks: dict[str, list[str]] = {}
    for g in groups:
        disk = disk_of(os.stat(g[0]).st_dev)
        if disk is not None:
            disks.setdefault(disk, []).append(g[0])
    for disk, firsts in disks.items():
        if len(firsts) > 1:
            notes.append(
                f"{' and '.join(firsts)} are different filesystems on the same disk ({disk}): "
                "the set cannot beat one drive"
            )
    for d, direct in zip(drive.dirs, drive.direct, strict=False):
        kind = fs_type(d)
        if kind in ("tmpfs", "ramfs"):
            notes.append(
                f"{d} is on {kind} (memory{'' if direct else ', no O_DIRECT'}): its figures are "
                "memory copies, not a drive, and say nothing about what drives give together"
            )
        elif not direct:
            notes.append(
                f"{d} ({kind or 'its filesystem'}) has no O_DIRECT and is measured through the page "
                "cache: its figures are memory copies, not a drive"
            )
    return notes


@dataclass
class Sweep:
    """A search over a Space on a Drive: trials, their statistics and the pick."""

    drive: Drive
    space: Space
    directions: list[str]
    repeats: int = 2
    budget_seconds: float | None = None
    seed: int = 0
    quiet: bool = False
    trials: list[Trial] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.t0 = time.monotonic()
        self.progress = Progress(0, self.quiet)
        self._stages: tuple[str, ...] = ()
        self.out_of_budget = False
        # (setting, direction) -> GB/s samples, so ranking stays cheap.
        self._samples: dict[tuple[Setting, str], list[float]] = {}
        # Leaders' median score relative to their round's mean (paired rounds).
        self.confirmed: dict[Setting, float] = {}

    # -- measuring -------------------------------------------------------------
    def _budget_left(self) -> bool:
        if self.budget_seconds is None:
            return True
        if time.monotonic() - self.t0 > self.budget_seconds:
            self.out_of_budget = True
            return False
        return True

    def measure(self, settings: Sequence[Setting], repeats: int, stage: str) -> None:
        """Each repeat visits every setting in a fresh random order, so slow
        drift of the drive (bursts, host cache) spreads over all of them."""
        self.progress.begin(self._stage_label(stage), len(settings) * repeats * len(self.directions))
        nbytes = self.drive.io_size * len(self.drive.paths)
        for _ in range(repeats):
            order = list(settings)
            self.rng.shuffle(order)
            for s in order:
                for d in self.directions:
                    if not self._budget_left():
                        return
                    check_interrupt()
                    sec = self.drive.run(s, d)
                    gbps = nbytes / sec / 1e9
                    self.trials.append(Trial(s, d, gbps, sec, nbytes, stage))
                    self._samples.setdefault((s, d), []).append(gbps)
                    note = ""
                    if not self.quiet:
                        best = self.best()
                        note = f"best {self.score(best):.2f} GB/s {best.short()}" if best else ""
                    self.progress.step(note)

    # -- statistics --------------------------------------------------------------
    def samples(self, s: Setting, direction: str) -> list[float]:
        """The GB/s samples of `s` in `direction`."""
        return list(self._samples.get((s, direction), ()))

    def median(self, s: Setting, direction: str) -> float:
        """Median GB/s of `s` in `direction` (0.0 when not measured)."""
        xs = self.samples(s, direction)
        return statistics.median(xs) if xs else 0.0

    def score(self, s: Setting) -> float:
        """Harmonic mean of the per-direction medians: the rate at which equal
        amounts of reading and writing get done."""
        meds = [self.median(s, d) for d in self.directions]
        if any(m <= 0 for m in meds):
            return 0.0
        return len(meds) / sum(1 / m for m in meds)

    def measured(self) -> list[Setting]:
        """Settings measured in every direction."""
        seen = {s for s, _ in self._samples}
        return [s for s in seen if all((s, d) in self._samples for d in self.directions)]

    def ranking(self) -> list[Setting]:
        """Measured settings, best score first."""
        return sorted(self.measured(), key=self.score, reverse=True)

    def best(self) -> Setting | None:
        """The pick: the best confirmed setting, else the top of the ranking (None before any trial)."""
        if self.confirmed:
            return max(self.confirmed, key=lambda s: self.confirmed[s])
        r = self.ranking()
        return r[0] if r else None

    def spread(self, s: Setting) -> tuple[float, float]:
        """(lowest, highest) score over repeats, pairing the i-th samples."""
        per = [self.samples(s, d) for d in self.directions]
        n = min(len(x) for x in per)
        scores = [len(per) / sum(1 / x[i] for x in per) for i in range(n)]
        return (min(scores), max(scores)) if scores else (0.0, 0.0)

    # -- searches ------------------------------------------------------------------
    STAGES = {
        "exhaustive": ("exhaustive",),
        "smart": ("coarse", "refine", "confirm"),
    }
    STAGE_HELP = {
        "exhaustive": "every setting of the grid",
        "coarse": "block size x queue depth x single_submit",
        "refine": "threads x overlap_events x engine around the 4 best",
        "confirm": "the 6 leaders head to head",
    }

    @classmethod
    def plan(cls, mode: str) -> str:
        """What `mode` ("smart" or "exhaustive") will run, in one line for the
        user, said up front since each stage's size is known only when it
        begins."""
        stages = cls.STAGES[mode]
        return "; ".join(f"{i}. {st} ({cls.STAGE_HELP[st]})" for i, st in enumerate(stages, 1))

    def _stage_label(self, stage: str) -> str:
        stages = self._stages
        if stage in stages and len(stages) > 1:
            return f"{stage}, stage {stages.index(stage) + 1} of {len(stages)}"
        return stage

    def exhaustive(self) -> None:
        """Measure every setting of the grid `repeats` times."""
        self._stages = self.STAGES["exhaustive"]
        self.measure(self.space.all(), self.repeats, "exhaustive")

    def smart(self) -> None:
        """Coarse pass, refinement around the four best, then the leaders head to head."""
        self._stages = self.STAGES["smart"]
        sp = self.space
        t0 = 1 if 1 in sp.threads else sp.threads[0]
        ov0 = True if True in sp.overlap_events else sp.overlap_events[0]
        e0 = sp.engines[0]
        # Stage 1: block size x queue depth x single_submit, the settings that
        # move throughput most, one pass (the confirm stage absorbs noise).
        coarse = [
            Setting(b, q, t0, ss, ov0, e0)
            for b in sp.block_sizes
            for q in sp.queue_depths
            for ss in sp.single_submit
        ]
        self.measure(coarse, max(1, self.repeats - 1), "coarse")
        top = [s for s in self.ranking() if s in coarse][:4]
        # Stage 2: threads x overlap_events x engine around the four best.
        fine = []
        for s in top:
            for t, ov, e in itertools.product(sp.threads, sp.overlap_events, sp.engines):
                cand = Setting(s.block_size, s.queue_depth, t, s.single_submit, ov, e)
                if cand not in coarse and cand not in fine:
                    fine.append(cand)
        self.measure(fine, max(1, self.repeats - 1), "refine")
        # Stage 3: the leaders head to head, so the pick is not one lucky run.
        self.confirm(self.ranking()[:6], rounds=3)

    def confirm(self, leaders: list[Setting], rounds: int) -> None:
        """Paired rounds: each round runs every leader twice, in an order and
        its reverse (A B C .. C B A), and scores each leader relative to the
        round's mean. The drive's slow drift (bursts after idle, host cache
        filling) hits every leader of a round alike and cancels out; the
        final pick is the best median relative score."""
        if len(leaders) < 2:
            return
        self.progress.begin(self._stage_label("confirm"), len(leaders) * 2 * rounds * len(self.directions))
        nbytes = self.drive.io_size * len(self.drive.paths)
        rel: dict[Setting, list[float]] = {s: [] for s in leaders}
        for _ in range(rounds):
            order = list(leaders)
            self.rng.shuffle(order)
            spent = dict.fromkeys(leaders, 0.0)
            for s in order + order[::-1]:
                for d in self.directions:
                    if not self._budget_left():
                        return
                    check_interrupt()
                    sec = self.drive.run(s, d)
                    spent[s] += sec
                    gbps = nbytes / sec / 1e9
                    self.trials.append(Trial(s, d, gbps, sec, nbytes, "confirm"))
                    self._samples.setdefault((s, d), []).append(gbps)
                    self.progress.step(f"confirming {len(leaders)} leaders")
            # Equal bytes per leader, so rate = bytes / time is the harmonic
            # mean of its read and write rates.
            score = {s: 1.0 / spent[s] for s in leaders}
            mean = statistics.mean(score.values())
            for s in leaders:
                rel[s].append(score[s] / mean)
        self.confirmed = {s: statistics.median(v) for s, v in rel.items()}


def _harmonic(xs: Sequence[float]) -> float:
    """Harmonic mean (the rate of equal amounts of each); 0.0 when any is 0."""
    return 0.0 if not xs or any(x <= 0 for x in xs) else len(xs) / sum(1 / x for x in xs)


@dataclass
class Comparison:
    """Each drive alone and the set together at one setting: GB/s samples
    per direction. Figures are medians; ``score`` is their harmonic mean."""

    dirs: list[str]
    setting: Setting
    directions: list[str]
    rounds: int
    alone: list[dict[str, list[float]]]
    together: dict[str, list[float]]

    def _row(self, samples: dict[str, list[float]]) -> dict[str, float]:
        row = {d: statistics.median(samples[d]) if samples[d] else 0.0 for d in self.directions}
        row["score"] = _harmonic([row[d] for d in self.directions])
        return row

    def columns(self) -> list[str]:
        """The figures of each row: the directions, then ``score``."""
        return [*self.directions, "score"]

    def alone_rows(self) -> list[dict[str, float]]:
        """Per drive alone: median GB/s per direction and the score."""
        return [self._row(x) for x in self.alone]

    def set_row(self) -> dict[str, float]:
        """The set together: total bytes over the wall time of the concurrent phase, GB/s."""
        return self._row(self.together)

    def vs_best_single(self) -> dict[str, float]:
        """The set's figures over the best single drive's (per column)."""
        rows, st = self.alone_rows(), self.set_row()
        return {c: st[c] / max(r[c] for r in rows) if max(r[c] for r in rows) > 0 else 0.0 for c in st}

    def efficiency(self) -> dict[str, float]:
        """Scaling efficiency: the set's figures over the sum of the singles' (per column)."""
        rows, st = self.alone_rows(), self.set_row()
        return {c: st[c] / sum(r[c] for r in rows) if sum(r[c] for r in rows) > 0 else 0.0 for c in st}


def compare(drive: Drive, s: Setting, directions: list[str], rounds: int, seed: int = 0) -> Comparison:
    """Measure each drive alone and all of them together at setting `s`.

    Each round visits the entries (every drive alone, then the set) in a fresh
    random order, so the drives' drift spreads over all of them. The set's
    trial gives every drive its own handle and submits to all at once; its
    rate is the total bytes over the wall time until the last drive is done.
    """
    rng = random.Random(seed)
    n = len(drive.dirs)
    entries: list[tuple[int, ...]] = [(i,) for i in range(n)] + [tuple(range(n))]
    samples: dict[tuple[int, ...], dict[str, list[float]]] = {e: {d: [] for d in directions} for e in entries}
    progress = Progress(rounds * len(entries) * len(directions), quiet=False)
    for _ in range(rounds):
        order = list(entries)
        rng.shuffle(order)
        for e in order:
            for d in directions:
                check_interrupt()
                sec = drive.run(s, d, e)
                samples[e][d].append(drive.io_size * len(e) / sec / 1e9)
                progress.step("each drive alone and the set together")
    progress.close()
    alone = [samples[(i,)] for i in range(n)]
    return Comparison(list(drive.dirs), s, list(directions), rounds, alone, samples[tuple(range(n))])


def fio_reference(path: str, s: Setting, io_size: int, direction: str) -> float | None:
    """fio (libaio, O_DIRECT) at the same settings on the same file: GB/s."""
    fio = shutil.which("fio")
    if not fio:
        return None
    per = io_size // s.thread_count
    cmd = [
        fio,
        "--name=aio-sweep-ref",
        f"--filename={path}",
        f"--rw={direction}",
        f"--bs={s.block_size}",
        f"--iodepth={s.queue_depth}",
        "--ioengine=libaio",
        "--direct=1",
        f"--size={per}",
        f"--numjobs={s.thread_count}",
        f"--offset_increment={per}",
        "--group_reporting",
        "--output-format=json",
        "--thread",
    ]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300).stdout
        job = json.loads(out[out.index("{") :])["jobs"][0][direction]
        return float(job["bw_bytes"]) / 1e9
    except (subprocess.SubprocessError, ValueError, KeyError, OSError):
        return None


def plot(sweep: Sweep, path: str) -> None:
    """Save a PNG of median GB/s over block size, one line per queue depth."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SweepError("--plot needs matplotlib (pip install matplotlib)") from None
    fig, axes = plt.subplots(
        1, len(sweep.directions), figsize=(6 * len(sweep.directions), 4.5), squeeze=False
    )
    sp = sweep.space
    for ax, d in zip(axes[0], sweep.directions, strict=False):
        for q in sp.queue_depths:
            xs, ys = [], []
            for b in sp.block_sizes:
                vals = [
                    sweep.median(s, d) for s in sweep.measured() if s.block_size == b and s.queue_depth == q
                ]
                if vals:
                    xs.append(b)
                    ys.append(max(vals))
            if xs:
                ax.plot(xs, ys, marker="o", label=f"queue_depth {q}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block_size (bytes)")
        ax.set_ylabel("GB/s (median; best over threads/modes)")
        ax.set_title(f"{d}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("aio-sweep: " + ", ".join(sweep.drive.dirs))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sizes(text: str) -> list[int]:
    return [parse_size(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _bools(text: str) -> list[bool]:
    m = {"true": True, "false": False, "1": True, "0": False}
    try:
        return [m[x.strip().lower()] for x in text.split(",") if x.strip()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected true/false values, got {text!r}") from None


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a positive finite number of seconds, got {text!r}")
    return v


def _engines(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    for n in names:
        if n not in ENGINE_TAGS:
            raise argparse.ArgumentTypeError(f"unknown engine {n!r}; choose from {', '.join(ENGINE_TAGS)}")
    return names


def available_engines() -> tuple[list[str], list[str]]:
    """(the engines a handle can use here, a note per one it cannot)."""
    ok, notes = [], []
    for e in ENGINE_TAGS:
        try:
            AsyncIOHandle(engine=e).close()
            ok.append(e)
        except OSError as err:
            notes.append(f"engine {e} left out: {err}")
    return ok, notes


def build_parser() -> argparse.ArgumentParser:
    """The aio-sweep command line."""
    ap = CliParser(
        prog="aio-sweep",
        description=(__doc__ or "").splitlines()[0],
    )
    ap.add_argument(
        "dirs",
        nargs="*",
        metavar="DIR",
        help=(
            "directory to measure, one per drive; with several, each drive alone and the set "
            "together are compared (default: a temporary directory, removed after)"
        ),
    )
    ap.add_argument(
        "--block-sizes",
        type=_sizes,
        default=_sizes("128K,256K,512K,1M,2M,4M"),
        help="block_size values to try, comma-separated (default: 128K,256K,512K,1M,2M,4M)",
    )
    ap.add_argument(
        "--queue-depths",
        type=_ints,
        default=_ints("4,8,16,32,64"),
        help="queue_depth values to try (default: 4,8,16,32,64)",
    )
    ap.add_argument(
        "--threads",
        type=_ints,
        default=_ints("1,2,4"),
        help="thread_count (intra_op_parallelism) values to try (default: 1,2,4)",
    )
    ap.add_argument(
        "--single-submit",
        type=_bools,
        default=[False, True],
        metavar="BOOLS",
        help="single_submit values to try (default: false,true)",
    )
    ap.add_argument(
        "--overlap-events",
        type=_bools,
        default=[True, False],
        metavar="BOOLS",
        help="overlap_events values to try (default: true,false)",
    )
    ap.add_argument(
        "--engines",
        type=_engines,
        metavar="ENGINES",
        help="kernel_aio,io_uring (default: both where this kernel allows io_uring)",
    )
    ap.add_argument(
        "--io-size",
        type=parse_size,
        default=parse_size("256M"),
        help="bytes per trial per DIR (default: 256M)",
    )
    ap.add_argument("--repeats", type=int_in(1, 1000), default=2, help="runs per configuration and direction")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--read-only", action="store_true", help="measure reads only")
    g.add_argument("--write-only", action="store_true", help="measure writes only")
    ap.add_argument("--exhaustive", action="store_true", help="measure the full grid")
    ap.add_argument("--budget-seconds", type=_seconds, help="stop measuring after this long")
    ap.add_argument("--json", metavar="FILE", help="write every trial as JSON")
    ap.add_argument("--plot", metavar="PNG", help="plot throughput over block size x queue depth")
    ap.add_argument("--emit-config", action="store_true", help="print only the aio block")
    ap.add_argument("--allow-buffered", action="store_true", help="sweep even without O_DIRECT")
    ap.add_argument("--no-fio", action="store_true", help="skip the fio reference run")
    ap.add_argument("--top", type=int_in(1, 1_000_000), default=8, help="rows in the results table")
    ap.add_argument("--seed", type=int, default=0, help="seed of the search's random choices")
    return ap


def validate_args(ap: argparse.ArgumentParser, a: argparse.Namespace) -> Space:
    """Refuse out-of-range values (one-line error, exit 2); the Space to search."""
    for name in ("block_sizes", "queue_depths", "threads", "single_submit", "overlap_events"):
        if not getattr(a, name):
            ap.error(f"--{name.replace('_', '-')} must list at least one value")
    for b in a.block_sizes:
        if b <= 0 or b % 4096 or b > 1 << 30:
            ap.error(f"--block-sizes: {b} is not a positive multiple of 4096 up to 1G")
    for q in a.queue_depths:
        if not 1 <= q <= 65536:
            ap.error(f"--queue-depths: {q} is outside 1..65536")
    for t in a.threads:
        if not 1 <= t <= 256:
            ap.error(f"--threads: {t} is outside 1..256")
    if a.io_size < 1 << 20 or a.io_size % 4096:
        ap.error("--io-size must be at least 1M and a multiple of 4096")
    # A block past --io-size moves a trial in one request, as --io-size does:
    # every larger one measures the same, so one of them could win on noise.
    fitting = [b for b in a.block_sizes if b <= a.io_size]
    if not fitting:
        ap.error(f"--block-sizes: each is larger than --io-size {a.io_size}, the bytes each trial moves")
    too_big, a.block_sizes = sorted(set(a.block_sizes) - set(fitting)), fitting
    if a.repeats < 1:
        ap.error("--repeats must be >= 1")
    dedup = lambda xs: list(dict.fromkeys(xs))  # noqa: E731
    engines, notes = available_engines()
    if a.engines is not None:
        if not a.engines:
            ap.error("--engines must list at least one value")
        for e in a.engines:
            if e not in engines:
                ap.error(next(n for n in notes if n.startswith(f"engine {e} ")))
        engines, notes = dedup(a.engines), []
    if not engines:
        ap.error("; ".join(notes))
    if too_big:
        notes = [
            *notes,
            f"--block-sizes {', '.join(map(str, too_big))} left out: larger than --io-size {a.io_size} "
            "(one request per trial, as at --io-size)",
        ]
    a.engine_notes = notes  # said before measuring
    _check_aio_events(ap, a, engines)
    return Space(
        sorted(set(a.block_sizes)),
        sorted(set(a.queue_depths)),
        sorted(set(a.threads)),
        dedup(a.single_submit),
        dedup(a.overlap_events),
        engines,
    )


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _check_aio_events(ap: argparse.ArgumentParser, a: argparse.Namespace, engines: list[str]) -> None:
    """kernel_aio: each handle's threads take queue_depth events each from
    the system-wide fs.aio-max-nr. Refuse a space whose largest setting
    cannot be set up now, before measuring for minutes (io_setup failed
    with EAGAIN mid-sweep and every measurement was lost)."""
    limit, used = _read_int("/proc/sys/fs/aio-max-nr"), _read_int("/proc/sys/fs/aio-nr")
    if "kernel_aio" not in engines or limit is None:
        return
    dirs = max(1, len(a.dirs))
    need = max(a.queue_depths) * max(a.threads) * dirs
    if need > limit - (used or 0):
        ap.error(
            f"--queue-depths {max(a.queue_depths)} x --threads {max(a.threads)} x {dirs} "
            f"director{'y' if dirs == 1 else 'ies'} take {need} kernel AIO events; fs.aio-max-nr is "
            f"{limit} ({used or 0} in use now): lower them, raise it (sysctl -w fs.aio-max-nr=1048576), "
            "or sweep --engines io_uring"
        )


def _check_output(ap: argparse.ArgumentParser, flag: str, path: str | None) -> None:
    """--json/--plot: refuse a path that cannot be written before measuring for minutes."""
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        ap.error(f"{flag} {path}: is a directory")
    if not os.path.isdir(parent):
        ap.error(f"{flag} {path}: no such directory {parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        ap.error(f"{flag} {path}: {parent} is not writable by this user")


def main(argv: Sequence[str] | None = None) -> int:
    """aio-sweep: find the fastest handle settings for the given drives; exit status."""
    ap = build_parser()
    a = ap.parse_args(argv)
    space = validate_args(ap, a)
    _check_output(ap, "--json", a.json)
    _check_output(ap, "--plot", a.plot)
    return run_cli("aio-sweep", lambda: _sweep(a, space), "sweep files removed")


def _warn_not_drives(drive: Drive, log: Any) -> None:
    """Say which directories --allow-buffered let through: in memory, or
    without O_DIRECT (their figures are memory copies, not the drive)."""
    in_memory = [d for d, m in zip(drive.dirs, drive.memory, strict=True) if m]
    buffered = [
        d for d, m, ok in zip(drive.dirs, drive.memory, drive.direct, strict=True) if not ok and not m
    ]
    if in_memory:
        log(
            f"aio-sweep: WARNING: {', '.join(in_memory)} in memory (tmpfs/ramfs): its figures are memory "
            "copies, not a drive (--allow-buffered)"
        )
    if buffered:
        where = "here" if len(drive.dirs) == 1 else "in " + ", ".join(buffered)
        log(f"aio-sweep: WARNING: no O_DIRECT {where}; measuring buffered I/O (--allow-buffered)")


def _sweep(a: argparse.Namespace, space: Space) -> int:
    directions = ["read"] if a.read_only else ["write"] if a.write_only else ["read", "write"]
    log = (lambda *x: print(*x, file=sys.stderr)) if a.emit_config else print
    tmp = None
    if not a.dirs:
        tmp = tempfile.mkdtemp(prefix="aio-sweep-")
        a.dirs = [tmp]
        log(f"aio-sweep: no DIR given; measuring a temporary directory, {tmp}")
    drive = Drive(a.dirs, a.io_size, a.allow_buffered)
    try:
        drive.check()
        _warn_not_drives(drive, log)
        mode = "exhaustive" if a.exhaustive else "smart"
        for note in getattr(a, "engine_notes", []):
            log(f"aio-sweep: {note}")
        log(
            f"aio-sweep: {mode} search over {space.size()} configurations, "
            f"{a.io_size / 2**20:.0f} MiB per trial per DIR, {', '.join(directions)}, "
            f"{a.repeats} repeats"
        )
        log(
            f"aio-sweep: set-up: locking a {a.io_size * len(drive.dirs) / 2**20:.0f} MiB buffer and "
            f"writing a {a.io_size / 2**20:.0f} MiB scratch file per DIR ..."
        )
        t_setup = time.monotonic()
        drive.prepare(log)
        log(f"aio-sweep: set-up done in {time.monotonic() - t_setup:.1f} s; measuring")
        if not drive.locked:
            log("aio-sweep: the buffer is NOT locked (mlock refused); rates may be a little low")
        sweep = Sweep(drive, space, directions, a.repeats, a.budget_seconds, a.seed, quiet=False)
        log(f"aio-sweep: stages: {sweep.plan(mode)}")
        t0 = time.monotonic()
        try:
            (sweep.exhaustive if a.exhaustive else sweep.smart)()
        except KeyboardInterrupt:
            sweep.progress.close()
            _report_interrupted(a, sweep, time.monotonic() - t0, log)
            raise
        sweep.progress.close()
        elapsed = time.monotonic() - t0
        best = sweep.best()
        comp = None
        if best is not None and len(drive.dirs) > 1:
            log(f"aio-sweep: measuring each drive alone and the set together at {best.short()}")
            comp = compare(drive, best, directions, max(3, a.repeats), a.seed)
        return _report(a, sweep, mode, elapsed, log, comp)
    finally:
        drive.cleanup()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _report_interrupted(a: argparse.Namespace, sweep: Sweep, elapsed: float, log: Any) -> None:
    """What an interrupted sweep measured so far: the table, no pick (the
    search did not finish, so its leader is not confirmed)."""
    if not sweep.measured():
        log("\naio-sweep: interrupted before any configuration was measured")
        return
    log(
        f"\naio-sweep: interrupted after {len(sweep.trials)} trials ({elapsed:.0f} s); what it measured "
        "so far (incomplete: no aio block is recommended from it):"
    )
    _ranking_table(a, sweep, sweep.ranking(), log)


def _ranking_table(a: argparse.Namespace, sweep: Sweep, ranking: list[Setting], log: Any) -> None:
    """The ranking's first --top rows; a row with a single sample in some
    direction is marked: its score rests on one trial."""
    directions = sweep.directions
    hdr = "  ".join(f"{d:>14s}" for d in directions)
    log(f"\n  rank  {'configuration':36s}  {hdr}   score GB/s [spread]  head-to-head")
    single = False
    for i, s in enumerate(ranking[: a.top], 1):
        cols = "  ".join(f"{sweep.median(s, d):6.2f} (n={len(sweep.samples(s, d))})" for d in directions)
        lo, hi = sweep.spread(s)
        h2h = f"{sweep.confirmed[s]:.3f}" if s in sweep.confirmed else ""
        one = any(len(sweep.samples(s, d)) < 2 for d in directions)
        single |= one
        mark = "*" if one else " "
        log(f"  {i:4d}{mark} {s.short():36s}  {cols}   {sweep.score(s):5.2f} [{lo:.2f}..{hi:.2f}]  {h2h}")
    if single:
        log("  * one sample in some direction: that score rests on a single trial and may be noise")


def _report(
    a: argparse.Namespace, sweep: Sweep, mode: str, elapsed: float, log: Any, comp: Comparison | None = None
) -> int:
    best = sweep.best()
    if best is None:
        print("aio-sweep: no configuration was measured (budget too small?)", file=sys.stderr)
        return 1
    ranking = sweep.ranking()
    if sweep.confirmed:  # the head-to-head order decides among the leaders
        lead = sorted(sweep.confirmed, key=lambda s: -sweep.confirmed[s])
        ranking = lead + [s for s in ranking if s not in sweep.confirmed]
    log(f"\nmeasured {len(sweep.measured())} configurations, {len(sweep.trials)} trials in {elapsed:.0f} s")
    if sweep.out_of_budget:
        log(f"note: stopped at --budget-seconds {a.budget_seconds}; the search is incomplete")
    if comp is not None:
        log(f"(the search measured the {len(comp.dirs)} directories together: GB/s of the set)")
    _ranking_table(a, sweep, ranking, log)
    if sweep.confirmed:
        log("  (head-to-head: median score relative to the leaders' mean in paired rounds)")
        top2 = sorted(sweep.confirmed.values(), reverse=True)[:2]
        if len(top2) == 2 and top2[0] - top2[1] < 0.02:
            log("  note: the top two are within 2% head to head: indistinguishable on this drive")
    elif len(ranking) > 1:
        lo1, hi1 = sweep.spread(ranking[0])
        lo2, hi2 = sweep.spread(ranking[1])
        if lo1 <= hi2:
            log(
                "  note: the top two overlap within their spread; on this drive they are "
                "indistinguishable -- either is a good choice"
            )
    notes = device_notes(sweep.drive) if comp is not None else []
    if comp is not None:
        _report_set(comp, notes, log)
    ref = _fio(a, sweep, best, log, comp)
    if a.json:
        _write_json(a, sweep, mode, elapsed, best, ref, comp, notes)
    if a.plot:
        plot(sweep, a.plot)
        log(f"  plot written to {a.plot}")
    _print_block(a, sweep.drive, best, log)
    return 0


def _report_set(comp: Comparison, notes: list[str], log: Any) -> None:
    """The per-drive and set table, the ratios, and why the set cannot beat one drive."""
    cols = comp.columns()
    width = max(24, *(len(d) for d in comp.dirs))
    log(
        f"\neach drive alone and the {len(comp.dirs)} together at {comp.setting.short()} "
        f"(GB/s, median of {comp.rounds} rounds; score = harmonic mean of {' and '.join(comp.directions)}):"
    )
    log(f"  {'directory':{width}s}  " + "  ".join(f"{c:>8s}" for c in cols))
    for d, row in zip(comp.dirs, comp.alone_rows(), strict=True):
        log(f"  {d:{width}s}  " + "  ".join(f"{row[c]:8.2f}" for c in cols))
    st, vs, eff = comp.set_row(), comp.vs_best_single(), comp.efficiency()
    log(f"  {f'set of {len(comp.dirs)}, together':{width}s}  " + "  ".join(f"{st[c]:8.2f}" for c in cols))
    log(f"  {'set / best single':{width}s}  " + "  ".join(f"{vs[c]:7.2f}x" for c in cols))
    log(f"  {'set / sum of singles':{width}s}  " + "  ".join(f"{eff[c]:7.0%} " for c in cols).rstrip())
    log("  (set / sum of singles is the scaling efficiency: 100% = every drive at its own full rate)")
    for n in notes:
        log(f"  note: {n}")
    log(
        f"  the set of {len(comp.dirs)} gives {vs['score']:.2f}x the best single drive "
        f"({eff['score']:.0%} of the sum of the singles)"
        + (
            "; see the notes: these are not separate drives, so this is not what drives would give"
            if notes
            else ""
        )
    )


def _print_block(a: argparse.Namespace, drive: Drive, best: Setting, log: Any) -> None:
    """The config snippet: the aio block; with several directories also both
    offload blocks' nvme_path as a list of them."""
    snippet: dict[str, Any] = {"aio": best.aio_block()}
    if len(drive.dirs) > 1:
        nvme = {"device": "nvme", "nvme_path": list(drive.dirs)}
        # stage 3: offload blocks are refused without it (a snippet that fails validation otherwise)
        snippet["zero_optimization"] = {
            "stage": 3,
            "offload_param": dict(nvme),
            "offload_optimizer": dict(nvme),
        }
        log(
            "\nnote: aio.zero takes nvme_path as a list of directories (one per drive); "
            "DeepSpeed takes one string only: under DeepSpeed keep one of these directories"
        )
    if not a.emit_config:
        if len(drive.dirs) > 1:
            print("\nbest aio block and the drives as nvme_path (merge into your config):")
        else:
            print("\nbest aio block (paste into your DeepSpeed config):")
    print(json.dumps(snippet, indent=2))


def _fio(
    a: argparse.Namespace, sweep: Sweep, best: Setting, log: Any, comp: Comparison | None = None
) -> dict[str, float]:
    """fio's rate at the best setting, per direction (empty without fio), on
    the first drive; with several drives, on each drive with O_DIRECT, each
    compared with that drive measured alone. Keys: direction, or
    ``directory:direction`` with several drives."""
    drive, directions = sweep.drive, sweep.directions
    ref: dict[str, float] = {}
    if a.no_fio or (drive.buffered and comp is None):
        return ref
    if comp is None:
        for d in directions:
            r = fio_reference(drive.paths[0], best, a.io_size, d)
            if r:
                ref[d] = r
                ratio = sweep.median(best, d) / r
                log(f"  fio at the same settings, {d}: {r:.2f} GB/s -> aio/fio = {ratio:.2f}")
    else:
        rows = comp.alone_rows()
        for i, (path, direct) in enumerate(zip(drive.paths, drive.direct, strict=True)):
            for d in directions if direct else []:
                r = fio_reference(path, best, a.io_size, d)
                if r:
                    ref[f"{drive.dirs[i]}:{d}"] = r
                    log(
                        f"  fio at the same settings, {drive.dirs[i]} {d}: {r:.2f} GB/s -> "
                        f"aio alone/fio = {rows[i][d] / r:.2f}"
                    )
    if not ref and not shutil.which("fio"):
        log("  (fio not installed: no device reference; apt-get install fio)")
    return ref


def _set_json(comp: Comparison, drive: Drive, notes: list[str]) -> dict[str, Any]:
    """The per-drive and set figures for --json."""

    def figures(row: dict[str, float]) -> dict[str, float]:
        return {f"{c}_gbps": row[c] for c in comp.columns()}

    drives = []
    for i, d in enumerate(comp.dirs):
        dev = os.stat(d).st_dev
        drives.append(
            {
                "dir": d,
                "st_dev": f"{os.major(dev)}:{os.minor(dev)}",
                "disk": disk_of(dev),
                "fs_type": fs_type(d),
                "o_direct": drive.direct[i] if i < len(drive.direct) else not drive.buffered,
                **figures(comp.alone_rows()[i]),
                "samples_gbps": comp.alone[i],
            }
        )
    together = {
        "dirs": comp.dirs,
        **figures(comp.set_row()),
        "samples_gbps": comp.together,
        "vs_best_single": comp.vs_best_single(),
        "scaling_efficiency": comp.efficiency(),
    }
    return {
        "compare_setting": comp.setting.aio_block(),
        "compare_rounds": comp.rounds,
        "drives": drives,
        "set": together,
        "notes": notes,
    }


def _write_json(
    a: argparse.Namespace,
    sweep: Sweep,
    mode: str,
    elapsed: float,
    best: Setting,
    ref: dict[str, float],
    comp: Comparison | None = None,
    notes: Sequence[str] = (),
) -> None:
    drive, space = sweep.drive, sweep.space
    data: dict[str, Any] = {
        "dirs": drive.dirs,
        "io_size": a.io_size,
        "mode": mode,
        "elapsed_s": elapsed,
        "space": asdict(space),
        "best": best.aio_block(),
        "fio_gbps": ref,
        "trials": [
            {
                **asdict(t.setting),
                "direction": t.direction,
                "gbps": t.gbps,
                "seconds": t.seconds,
                "bytes": t.nbytes,
                "stage": t.stage,
            }
            for t in sweep.trials
        ],
    }
    if comp is not None:
        data.update(_set_json(comp, drive, list(notes)))
    with open(a.json, "w") as f:
        json.dump(data, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
