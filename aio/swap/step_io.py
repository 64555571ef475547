"""StepIO: the buffers and I/O of one OptimizerSwapper.step().

The step pipeline: reads of the next sub-groups started ahead, write-backs
of the last ones behind, and the cache policy between steps: a stepped
sub-group keeps its buffers until a read needs them (written back first when
dirty), and what is kept when a step ends is the next step's first reads,
done already. Every lease and I/O in flight is tracked, so a failure (or a
Ctrl-C) can drain them all (:meth:`StepIO.abort`).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from ..pinned import Lease
from .copy import land_all
from .drives import IOFuture
from .param import SwapStateError
from .pool import BufferPool

if TYPE_CHECKING:
    from .optimizer import OptimizerSwapper
    from .subgroup import SubGroup

# The config key of the optimizer swapper's buffers (named in errors that ask for more).
BUFFER_COUNT_KEY = "zero_optimization.offload_optimizer.buffer_count"

# How often a wait for a sub-group's reads looks whether a write-back landed
# (its buffers then read ahead): ~4 MiB takes several ms on the drives measured.
_AHEAD_POLL_S = 0.0005

_Read = tuple[dict[str, Lease], list[IOFuture], bool]  # buffers, reads in flight, dirty
_Write = tuple[int, list[Lease], list[IOFuture]]


class StepIO:
    """The buffers and I/Os of one OptimizerSwapper.step(): reads ahead,
    write-backs behind, and every lease held, so a failure can drain them all.
    A sub-group being read holds one buffer per tensor (gradient first).

    A stepped sub-group keeps its buffers (`kept`, oldest first) until a read
    needs them: clean once its write landed, or dirty (write-back: written
    only when its buffers are needed). Whatever is kept when the step ends
    becomes the next step's first reads, done already. A read that waits
    for a write-back takes each buffer back as its own write lands
    (`split`: that sub-group is then not kept), not once all of them did;
    with every gradient held in memory and the master weights stepped in
    place (`by_buffer`) it starts reading a tensor into each buffer then,
    and a read ahead takes buffers so too.

    With every gradient held in memory, a read ahead with too few buffers
    free reads what they hold (`partial`: the tensors still to read): with 4
    buffers and 3 tensors a sub-group, the drive otherwise idles while each
    sub-group is computed. At most one
    read is partial, and none starts after it, so finish_read() can always
    complete it from the buffers of the sub-groups stepped before it."""

    def __init__(self, sw: OptimizerSwapper, pool: BufferPool) -> None:
        self.sw = sw
        self.pool = pool
        self.reads: dict[int, _Read] = {}
        self.writes: collections.deque[_Write] = collections.deque()
        self.kept: collections.OrderedDict[int, tuple[list[Lease], bool]] = collections.OrderedDict()
        self.held: list[Lease] = []
        self.partial: dict[int, list[str]] = {}  # sub-group -> tensors not yet being read
        self.carried: set[int] = set()  # reads done by carry_over(): the buffers kept by a step
        # id of a buffer's lease -> (the lease, the write-back from it in flight)
        self.written_from: dict[int, tuple[Lease, IOFuture]] = {}
        self.split: set[int] = set()  # write-backs that gave buffers back as their writes landed
        # Reads take a write-back's buffers one by one, ahead of need (fetch() sets it).
        self.by_buffer = False

    def _release(self, lease: Lease) -> None:
        lease.release()
        self.held.remove(lease)

    def _kept_parts(self, g: SubGroup) -> list[str]:
        """The tensors a stepped sub-group keeps a buffer for: the swapper's
        saved_parts() but the master weights where they are stepped in place."""
        parts = self.sw.saved_parts()
        return parts[1:] if g.master_pieces is not None else parts

    def _start_write(self, i: int, leases: list[Lease]) -> _Write:
        sw, g = self.sw, self.sw.groups[i]
        futs: list[IOFuture] = []
        try:
            for name, lease in zip(self._kept_parts(g), leases, strict=True):
                if name not in g.parts:  # master weights kept off the drive (master_slot)
                    continue
                off, n = g.part_io(name)
                futs.append(sw.space.write(lease.buffer()[:n], off))
                self.written_from[id(lease)] = (lease, futs[-1])
                sw.count_io("written", name, n)
        except BaseException:
            land_all(futs, quiet=True)  # no buffer goes back with a write still in it
            raise
        return (i, leases, futs)

    def _finish_write(self, entry: _Write) -> None:
        """Wait for a write-back; keep its buffers, clean (on failure they stay in
        `held`, which abort() gives back); those of one that gave some back
        early (_release_landed) go back too."""
        i, leases, futs = entry
        land_all(futs)
        self._forget_writes(leases)
        self.sw.groups[i].valid = True
        if i in self.split:
            self.split.discard(i)
            for lease in leases:
                self._release(lease)
            return
        self.kept[i] = (leases, False)

    def _release_landed(self) -> bool:
        """Give back the buffers of the oldest write-back whose own write landed,
        waiting for the first still in flight if none did: a read then reuses
        each buffer as its write lands, not once the whole sub-group's did
        (its sub-group is then not kept). False when none can come back so."""
        i, leases, futs = self.writes[0]
        mine = [self._write_from(lease) for lease in leases]
        if not any(f is not None and f.done() for f in mine):
            first = next((f for f in mine if f is not None), None)
            if first is None:
                return False
            first.wait()
        landed = [f is not None and f.done() for f in mine]
        land_all(
            [f for f, done in zip(mine, landed, strict=True) if done and f is not None]
        )  # a failure raises
        back = [lease for lease, done in zip(leases, landed, strict=True) if done]
        self._forget_writes(back)
        for lease in back:
            self._release(lease)
        self.writes[0] = (i, [lease for lease, done in zip(leases, landed, strict=True) if not done], futs)
        self.split.add(i)
        return True

    def _some_landed(self, entry: _Write) -> bool:
        """Whether a write of write-back `entry` whose buffer it still holds landed."""
        return any(f is not None and f.done() for f in map(self._write_from, entry[1]))

    def _write_from(self, lease: Lease) -> IOFuture | None:
        """The write-back in flight from `lease`'s buffer, if any."""
        got = self.written_from.get(id(lease))
        return got[1] if got is not None and got[0] is lease else None

    def _forget_writes(self, leases: list[Lease]) -> None:
        for lease in leases:
            if self._write_from(lease) is not None:
                del self.written_from[id(lease)]

    def _free_one(self, wait: bool) -> bool:
        """One move towards free buffers: drop the oldest clean kept sub-group,
        else take a landed write-back, or the buffers of the oldest one whose
        own writes landed (waiting for one if `wait`), else start writing the
        oldest dirty one; False when nothing can be done now."""
        for i, (leases, dirty) in self.kept.items():
            if not dirty:
                del self.kept[i]
                for lease in leases:
                    self._release(lease)
                return True
        if self.writes and all(f.done() for f in self.writes[0][2]):
            self._finish_write(self.writes.popleft())
            return True
        if self.writes and not wait and self.by_buffer and self._some_landed(self.writes[0]):
            # Not waiting either: a read ahead takes each buffer as its write
            # lands (the drive otherwise ran the other write alone meanwhile).
            return self._release_landed()
        if self.writes and wait:
            if not self._release_landed():
                self._finish_write(self.writes.popleft())
            return True
        if self.kept and not self.writes:
            i, (leases, _) = self.kept.popitem(last=False)
            self.writes.append(self._start_write(i, leases))
            return True
        return False

    def _lease(self, count: int, must: bool, need: int = 0) -> list[Lease] | None:
        """`count` free buffers, dropping kept sub-groups and finishing write-backs
        to free them (waiting only if `must`); None when they cannot be had and
        not `must`. `need`: the buffers the sub-group takes in all, for the
        error when the pool cannot give them (default `count`)."""
        while self.pool.available() < count and self._free_one(wait=must):
            pass
        if self.pool.available() < count and not must:
            return None
        leases: list[Lease] = []
        for _ in range(count):
            lease = self.pool.try_acquire()
            if lease is None:
                for got in leases:
                    self._release(got)
                raise SwapStateError(
                    f"stepping a sub-group needs {max(need, count)} free optimizer swap buffers; give back "
                    f"every buffer leased with acquire_buffer() before step(), or raise {BUFFER_COUNT_KEY}"
                )
            self.held.append(lease)
            leases.append(lease)
        return leases

    def _read_names(self, i: int) -> list[str]:
        """The tensors of sub-group i a read leases a buffer for, in order."""
        g = self.sw.groups[i]
        names = [n for n in g.parts if n != "grad" or g.grad_mem is None]
        if "param" not in g.parts and g.master_pieces is None:
            # Master weights kept off the drive take a buffer but no read:
            # leased last, so a partial read ahead spends its buffers on reads.
            # (Stepped in place, they take none.)
            names.append("param")
        return names

    def make_room(self, nxt: int) -> None:
        """Start now the write-back that reading sub-group `nxt` (or what a
        partial read left of it) will wait for: the oldest dirty kept
        sub-group's, when the free buffers fall short, no write-back is in
        flight and no clean kept sub-group could be dropped instead (what
        _lease() would do first). Never drops or reuses a buffer."""
        if nxt in self.reads and nxt not in self.partial:
            return
        need = len(self.partial[nxt]) if nxt in self.partial else len(self._read_names(nxt))
        if self.writes or not self.kept or self.pool.available() >= need:
            return
        if any(not dirty for _, dirty in self.kept.values()):
            return
        i, (leases, _) = self.kept.popitem(last=False)
        self.writes.append(self._start_write(i, leases))

    def start_read(self, i: int, must: bool, partly: bool = False) -> bool:
        """Lease a buffer per tensor of sub-group i (but a gradient held in
        memory) and start reading them all. Not `must`, with too few buffers
        free: with `partly`, start reading as many tensors as there are (none
        while another read is partial); False when nothing was started.
        `must` and `partly`: wait for one buffer only, and read into it and
        those free now (finish_read() reads the rest)."""
        sw, g = self.sw, self.sw.groups[i]
        names = self._read_names(i)
        if self.partial and not must:
            return False
        if must and partly and self.by_buffer and not self.partial:  # at most one read is partial
            leases = self._eager_leases(len(names))
            if len(leases) < len(names):
                self.partial[i] = names[len(leases) :]
        else:
            got = self._lease(len(names), must)
            if got is None:
                if not partly:
                    return False
                got = self._lease(min(self.pool.available(), len(names)), must=True)
                if not got:
                    return False
                self.partial[i] = names[len(got) :]
                sw.counters["partial_reads"] += 1
            leases = got
        self.reads[i] = ({}, [], False)
        self.carried.discard(i)
        g.settle_grad()
        self._read_parts(i, names[: len(leases)], leases)
        return True

    def _eager_leases(self, count: int) -> list[Lease]:
        """Buffers for a read of `count` tensors that waits for one only: the
        first tensor is read as soon as a write-back's buffer comes back, not
        once all of the sub-group's did (the drive otherwise ran the other
        writes alone, ~5 of each ~10 ms sub-group in bench/fsdp_step.py's
        nvme-params); the rest as many as are free now."""
        leases = self._lease(1, must=True, need=count) or []
        return leases + (self._lease(min(self.pool.available(), count - 1), must=False) or [])

    def finish_read(self, i: int) -> None:
        """Start reading whatever a partial read of sub-group i left (waiting for
        buffers: the sub-groups stepped before it free theirs)."""
        # One buffer at a time: each read starts as a write-back's buffer comes back.
        for name in self.partial.pop(i, None) or []:
            self._read_parts(i, [name], self._lease(1, must=True, need=len(self._read_names(i))) or [])

    def _read_parts(self, i: int, names: list[str], leases: list[Lease]) -> None:
        import torch

        sw, g = self.sw, self.sw.groups[i]
        have, futs, _ = self.reads[i]
        # Before its first step a sub-group's states are zeros set-up never wrote:
        # zeroed here instead of read (a fifth of step 1's reads with AdamW).
        fresh = {n for n, _ in sw.spec} if g.scalars is None else set()
        for name, lease in zip(names, leases, strict=True):
            have[name] = lease
            if name not in g.parts:
                continue  # master weights kept off the drive: taken from their source when stepped
            if name in fresh:
                lease.tensor(torch.uint8)[: g.part_io(name)[1]].zero_()
                continue
            futs.extend(sw.start_part_read(g, name, lease))

    def fetch(self, i: int, nxt: int | None, partly: bool) -> dict[str, Lease]:
        """Sub-group i's buffers, its tensors read (started now if not ahead;
        `by_buffer`, each as a buffer comes back), while reading ahead
        sub-group `nxt` (None: none) into buffers that are free or come free
        meanwhile (`partly`: as start_read)."""
        # Only for sub-groups stepped in place (two moments a read): measured 3-5 %
        # faster there (bench/fsdp_step.py nvme-params), 2-5 % slower with the
        # master weights on the drive too (nvme-drive: three tensors in four buffers).
        self.by_buffer = partly and self.sw.groups[i].master_pieces is not None
        if i not in self.reads:
            self.start_read(i, must=True, partly=partly)
        self.finish_read(i)  # before any read ahead takes the buffers it needs
        if nxt is not None and nxt not in self.reads:
            self.start_read(nxt, must=False, partly=partly)
        # While i's reads land, the write-back started beside them may land
        # first: its buffers then read ahead at once, not after i's reads and
        # update (measured: the drive ran one read at a time for ~6 ms of
        # each ~14 ms sub-group; counters["ahead_in_wait"] counts them).
        leases = self.take_read(i, nxt, partly=partly)
        if nxt is not None and nxt not in self.reads:
            # Again: the write-back started beside i's read may have landed
            # since, freeing buffers to read ahead into during i's update
            # (the drive idled through each update).
            self.start_read(nxt, must=False, partly=partly)
        return leases

    def take_read(self, i: int, ahead: int | None = None, partly: bool = False) -> dict[str, Lease]:
        """Wait for sub-group i's reads; return the buffers holding its tensors.
        With `ahead` (a sub-group not being read), start reading it (`partly`:
        as start_read) as soon as a write-back landing meanwhile frees buffers."""
        self.finish_read(i)
        if ahead is not None:
            self._read_ahead_while(self.reads[i][1], ahead, partly)
        leases, futs, _ = self.reads.pop(i)
        if i in self.carried:  # kept in its buffers by the step before: nothing read
            self.carried.discard(i)
            self.sw.counters["cached_subgroups"] += 1
        land_all(futs)
        return leases

    def _read_ahead_while(self, futs: list[IOFuture], ahead: int, partly: bool) -> None:
        """Until `futs` (reads) land: whenever the oldest write-back has landed
        (`by_buffer`: one of its writes), try to start reading sub-group
        `ahead`; stop once it started, or when no write-back is in flight
        (then nothing frees a buffer meanwhile)."""
        pending = [f for f in futs if not f.done()]
        while pending and ahead not in self.reads and self.writes:
            landed = self.writes[0]
            if all(f.done() for f in landed[2]) or (self.by_buffer and self._some_landed(landed)):
                if self.start_read(ahead, must=False, partly=partly):
                    self.sw.counters["ahead_in_wait"] += 1
                    return
                if self.writes and self.writes[0] is landed:
                    return  # refused without taking it (a partial read is on): no use waiting
                continue  # taken, too few buffers still: wait for the next write-back, if any
            pending[0].wait(_AHEAD_POLL_S)
            pending = [f for f in pending if not f.done()]

    def done_stepping(self, i: int, leases: dict[str, Lease], write_back: bool) -> None:
        """Sub-group i is stepped: its gradient's buffer goes back; the rest are
        kept dirty (`write_back`), or written now, pipelined or waited for."""
        if "grad" in leases:
            self._release(leases["grad"])
        kept = [leases[name] for name in self._kept_parts(self.sw.groups[i])]
        if write_back:
            self.kept[i] = (kept, True)
            return
        self.writes.append(self._start_write(i, kept))
        if not self.sw.pipeline_write:
            self._finish_write(self.writes.pop())
        while self.writes and all(f.done() for f in self.writes[0][2]):
            self._finish_write(self.writes.popleft())

    def carry_over(self, next_order: list[int], read_ahead: bool) -> None:
        """End of a step: wait for the write-backs in flight; every sub-group still
        in its buffers becomes one of the next step's reads, done already (the
        next step goes in `next_order`, the reverse of this one, so they come
        first). With `read_ahead` (only when every gradient is held in memory:
        a read started now must not fetch a gradient the next step will not
        use), start reading the sub-groups after them into the buffers still free."""
        while self.writes:
            self._finish_write(self.writes.popleft())
        for i, (leases, dirty) in self.kept.items():
            self.reads[i] = (
                dict(zip(self._kept_parts(self.sw.groups[i]), leases, strict=True)),
                [],
                dirty,
            )
            self.carried.add(i)
        self.kept.clear()
        if read_ahead:
            for i in next_order:
                if i not in self.reads and not self.start_read(i, must=False, partly=True):
                    break

    def write_masters(self) -> None:
        """Write the master weights of every carried sub-group not yet on the
        drive, and wait; the sub-groups stay dirty (their states are not written)."""
        sw = self.sw
        futs: list[IOFuture] = []
        try:
            for i, (leases, _futs, dirty) in self.reads.items():
                if dirty and "param" in sw.groups[i].parts:
                    futs.append(sw.start_part_write(sw.groups[i], "param", leases["param"]))
        except BaseException:
            land_all(futs, quiet=True)  # a failed start: wait for those started, report its error
            raise
        land_all(futs)

    def write_back(self) -> None:
        """Write every carried sub-group not yet on the drive, and wait (the
        writes are tracked in `writes`, so abort() drains them after a failure;
        after a Ctrl-C, a second call waits for those already started)."""
        started = {entry[0] for entry in self.writes}
        for i, (leases, _futs, dirty) in list(self.reads.items()):
            if dirty and i not in started:
                parts = self._kept_parts(self.sw.groups[i])
                self.writes.append(self._start_write(i, [leases[n] for n in parts]))
        while self.writes:
            i, written, futs = self.writes[0]
            land_all(futs)
            self._forget_writes(written)
            self.writes.popleft()
            self.sw.groups[i].valid = True
            leases, futs, _ = self.reads[i]
            self.reads[i] = (leases, futs, False)

    def abort(self) -> None:
        """After a failure (or to give everything back): drain so nothing still
        reads into or writes from a buffer, keep the sub-groups whose writes
        landed valid, release every lease. Dirty sub-groups are lost. Each
        entry is dropped only once settled: run again after a Ctrl-C, it
        goes on where it stopped."""
        for _leases, futs, _ in self.reads.values():
            for fut in futs:
                fut.exception()
        while self.writes:
            i, _kept, futs = self.writes[0]
            errors = [fut.exception() for fut in futs]  # every one waited for
            if all(e is None for e in errors):
                self.sw.groups[i].valid = True
            self.writes.popleft()
        while self.held:
            self.held[-1].release()  # waits for any I/O still on its buffer
            self.held.pop()
        self.reads.clear()
        self.carried.clear()
        self.kept.clear()
        self.partial.clear()
        self.written_from.clear()
        self.split.clear()
