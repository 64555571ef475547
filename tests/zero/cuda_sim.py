"""A strict CUDA simulator: aio.zero's GPU data path run on the CPU, failing
where a GPU would.

``with CudaSim(scheduler="lazy") as sim:`` makes ``device="cuda"`` work on a
CPU-only torch and installs a simulated backend for aio.zero's copies
(:func:`aio.zero.streams.set_backend_factory`). Everything a GPU does that
the older ``fake_streams`` could not see is modelled:

- **Device memory.** Tensors made with ``device="cuda"`` (factories,
  ``.to``/``.cuda``) and aio's own device allocations live in one arena cut
  into blocks by a caching allocator with CUDA's reuse rule: a freed block
  is reused only by allocations on the stream it was allocated on, and a
  block ``record_stream``-ed on other streams only after those streams have
  passed the point of the free. New and reused blocks are poisoned (0xFF
  bytes: NaN in every float dtype) by an op on the allocating stream. Peak
  bytes are counted. Results of kernels on device tensors are device
  tensors too (their storages are tagged); ``.device`` answers ``cuda:0``.
- **Streams and events** queue their work; copies are queued *by address*,
  so nothing keeps a tensor alive, and run only when the scheduler says:
  ``lazy`` (never, unless forced by a host wait or a kernel's data
  dependencies), ``eager`` (at once) or ``random`` (a seeded random amount
  after every call).
- **Vector clocks** per stream, event and the host thread (the design of
  ``torch.cuda._sanitizer``). Every access to device memory and to tracked
  pinned host memory (staging rings, swap pools, registered memory) is
  recorded; an access that nothing orders against an earlier conflicting one
  raises :class:`Hazard` with both stacks: an unordered device access across
  streams, a host read of a region whose D2H copy the host has not observed,
  a host write (a recycled staging region, a swap buffer leased again) to a
  region a queued H2D copy still reads, a freed block reused while another
  stream still uses it. A device storage freed while a queued copy reads it
  is a hazard too.
- **Kernels** are the aten ops on device tensors, run on the *current*
  stream (a TorchDispatchMode): they see only what their stream is ordered
  after, so a missing ``wait_event`` is caught. Mixing a device tensor with
  a non-scalar CPU tensor raises CUDA's device mismatch error; random ops on
  device tensors draw from a separate device generator.
- **Poison**: besides new device blocks, every recycled host region (a
  staging-ring region taken again, a swap-pool slot leased again) is filled
  with 0xFF before reuse.
- **Resizable storages** (FSDP2's shards, freed with
  ``untyped_storage().resize_(0)`` and allocated again with
  ``resize_(nbytes)``): :meth:`CudaSim.resizable` makes such a device
  tensor (its bytes in host memory outside the arena), :meth:`CudaSim.adopt`
  turns a host tensor's storage into one. Growing it from 0
  allocates on the current stream (poisoned there, as a new block);
  shrinking it to 0 is a free under the reuse rule: a use by another stream
  that neither the allocating stream nor the host is ordered after, and
  that was not ``record_stream``-ed, raises :class:`Hazard` (the allocator
  may hand the block to the allocating stream's next allocation at once).
- **Counters**: peak device bytes, pageable H2D/D2H copies, blocking host
  waits.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import ctypes
import linecache
import random
import sys
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

import aio.pinned
import aio.zero.streams as streams

DEVICE = torch.device("cuda", 0)
_BLOCK_ALIGN = 512
_SECTOR = 12  # hazard records are indexed by 4 KiB page
SCHEDULERS = ("lazy", "eager", "random")


class Hazard(AssertionError):
    """Two accesses to the same memory that nothing orders."""


class SimOutOfMemory(RuntimeError):
    """The simulated device's arena is full."""


class Deadlock(RuntimeError):
    """A wait that no queued work can ever satisfy."""


def _stack():
    """The caller's stack as (file, line, function) tuples: cheap to take at
    every access (no source lines read); formatted only for a Hazard."""
    out = []
    f = sys._getframe(3)
    while f is not None and len(out) < 14:
        out.append((f.f_code.co_filename, f.f_lineno, f.f_code.co_name))
        f = f.f_back
    return out[::-1]


def _format(stack):
    return "".join(
        f'  File "{fn}", line {ln}, in {name}\n    {linecache.getline(fn, ln).strip()}\n'
        for fn, ln, name in stack
    )


def _joined(a, b):
    out = dict(a)
    for k, v in b.items():
        if out.get(k, 0) < v:
            out[k] = v
    return out


class SimStream:
    """A stream: a FIFO of ops with a vector clock."""

    def __init__(self, sim, name):
        self.sim = sim
        self.name = name
        self.vc = {name: 0}
        self.queue = collections.deque()
        self.done_seq = 0

    def __repr__(self):
        return f"SimStream({self.name})"

    def _enqueue(self, kind, payload=None):
        # Work queued by the host is ordered after what the host did before.
        self.vc = _joined(self.vc, self.sim.host_vc)
        self.vc[self.name] += 1
        seq = self.vc[self.name]
        self.queue.append((kind, payload, seq))
        return seq, dict(self.vc)

    def wait_event(self, ev):
        """Later work on this stream waits for `ev`'s last record (no-op if never recorded)."""
        if ev.target is None:
            return
        self.vc = _joined(self.vc, ev.vc)
        self._enqueue("wait", ev.target)
        self.sim.after_call()

    def wait_stream(self, other):
        ev = self.sim.event()
        ev.record(other)
        self.wait_event(ev)

    def query(self):
        return not self.queue

    def synchronize(self):
        self.sim.host_wait(self, self.vc[self.name])
        self.sim.host_observe(self.vc)


class SimEvent:
    """An event: the clock of the stream at its last record."""

    def __init__(self, sim):
        self.sim = sim
        self.vc = None
        self.target = None  # (stream, seq) of the last record

    def record(self, stream=None):
        stream = stream or self.sim.current
        seq, self.vc = stream._enqueue("record")
        self.target = (stream, seq)
        self.sim.after_call()

    def query(self):
        if self.target is None:
            return True
        done = self.target[0].done_seq >= self.target[1]
        if done:
            self.sim.host_observe(self.vc)
        return done

    def synchronize(self):
        if self.target is not None:
            self.sim.host_wait(*self.target)
            self.sim.host_observe(self.vc)

    def wait(self, stream=None):
        (stream or self.sim.current).wait_event(self)


class _Record:
    __slots__ = ("lo", "hi", "write", "actor", "seq", "what", "stack")

    def __init__(self, lo, hi, write, actor, seq, what, stack):
        self.lo, self.hi, self.write, self.actor, self.seq = lo, hi, write, actor, seq
        self.what, self.stack = what, stack


class Accesses:
    """Who touched which bytes when; raises Hazard on an unordered conflict."""

    def __init__(self):
        self.pages = collections.defaultdict(list)

    def access(self, lo, hi, write, actor, seq, vc, what):
        if hi <= lo:
            return
        stack = None
        for page in range(lo >> _SECTOR, ((hi - 1) >> _SECTOR) + 1):
            recs = self.pages[page]
            keep = []
            for r in recs:
                overlap = r.lo < hi and lo < r.hi
                ordered = r.actor == actor or vc.get(r.actor, 0) >= r.seq
                if overlap and (r.write or write) and not ordered:
                    raise Hazard(_hazard_text(r, what, actor, lo, hi))
                covered = lo <= r.lo and r.hi <= hi and ordered and (write or not r.write)
                if not covered:
                    keep.append(r)
            if stack is None:
                stack = _stack()
            keep.append(_Record(lo, hi, write, actor, seq, what, stack))
            self.pages[page] = keep

    def unordered(self, lo, hi, vc, skip):
        """The first record in [lo, hi) by an actor not in `skip` that `vc` is not ordered after."""
        for page in range(lo >> _SECTOR, ((hi - 1) >> _SECTOR) + 1):
            for r in self.pages.get(page, ()):
                if r.lo < hi and lo < r.hi and r.actor not in skip and vc.get(r.actor, 0) < r.seq:
                    return r
        return None

    def forget(self, lo, hi):
        for page in range(lo >> _SECTOR, ((hi - 1) >> _SECTOR) + 1):
            recs = [r for r in self.pages.get(page, ()) if not (lo <= r.lo and r.hi <= hi)]
            if recs:
                self.pages[page] = recs
            else:
                self.pages.pop(page, None)


def _hazard_text(r, what, actor, lo, hi):
    old = _format(r.stack)
    new = _format(_stack())
    return (
        f"unordered access to bytes [{lo:#x}, {hi:#x}): {what} on {actor} is not ordered after "
        f"{'write' if r.write else 'read'} ({r.what}) on {r.actor} at [{r.lo:#x}, {r.hi:#x}), seq {r.seq}\n"
        f"--- earlier access:\n{old}--- this access:\n{new}"
    )


class SimAllocator:
    """CUDA's caching allocator, reduced to its reuse rule (see the module docstring)."""

    def __init__(self, sim, capacity):
        self.sim = sim
        self.arena = torch.empty(capacity + _BLOCK_ALIGN, dtype=torch.uint8)
        self.base = -(-self.arena.data_ptr() // _BLOCK_ALIGN) * _BLOCK_ALIGN
        self.capacity = capacity
        self.free_ranges = [(0, capacity)]
        self.cached = collections.defaultdict(list)  # stream name -> [(off, size)]
        self.pending = []  # (off, size, stream name, gates)
        self.in_use = 0
        self.peak = 0

    def contains(self, ptr):
        return self.base <= ptr < self.base + self.capacity

    def alloc(self, nbytes, stream):
        size = max(_BLOCK_ALIGN, -(-nbytes // _BLOCK_ALIGN) * _BLOCK_ALIGN)
        self._collect()
        off = self._reuse(size, stream.name)
        if off is None:
            off = self._carve(size)
        if off is None:
            self._flush()
            off = self._carve(size)
        if off is None:
            raise SimOutOfMemory(
                f"simulated device out of memory: {size} bytes wanted, {self.in_use} in use, "
                f"{self.capacity} in all"
            )
        self.in_use += size
        self.peak = max(self.peak, self.in_use + sum(p[1] for p in self.pending))
        return off, size

    def _reuse(self, size, name):
        fits = [b for b in self.cached[name] if size <= b[1] <= 2 * size]
        if not fits:
            return None
        best = min(fits, key=lambda b: b[1])
        self.cached[name].remove(best)
        if best[1] > size:
            self.cached[name].append((best[0] + size, best[1] - size))
        return best[0]

    def _carve(self, size):
        for i, (off, n) in enumerate(self.free_ranges):
            if n >= size:
                self.free_ranges[i] = (off + size, n - size)
                return off
        return None

    def _collect(self):
        still = []
        for off, size, name, gates in self.pending:
            if all(s.done_seq >= seq for s, seq in gates):
                # The allocator's event query succeeded: the host saw those streams get there.
                for s, seq in gates:
                    self.sim.host_observe({s.name: seq})
                self.cached[name].append((off, size))
            else:
                still.append((off, size, name, gates))
        self.pending = still

    def _flush(self):
        # CUDA frees its cached blocks (cudaFree synchronizes the device) before an OOM.
        self.sim.synchronize()
        self._collect()
        for blocks in self.cached.values():
            self.free_ranges.extend(blocks)
            blocks.clear()
        merged = []
        for off, n in sorted(self.free_ranges):
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            elif n:
                merged.append((off, n))
        self.free_ranges = merged

    def free(self, off, size, stream, used_on):
        gates = [(s, s.vc[s.name]) for s in used_on if s is not stream]
        if gates:
            self.pending.append((off, size, stream.name, gates))
        else:
            self.cached[stream.name].append((off, size))
        self.in_use -= size


class SimBackend:
    """What aio.zero.streams.DeviceCopies calls on its backend (see CudaBackend)."""

    def __init__(self, sim, device):
        self.sim = sim
        self.device = torch.device(device)
        self.side = sim.new_stream("side")

    def compute(self):
        return self.sim.current

    def event(self):
        return self.sim.event()

    def on(self, stream):
        return self.sim.stream(stream)

    def empty(self, numel, dtype):
        return self.sim.empty(numel, dtype)

    def pinned(self, nbytes):
        return self.sim.pinned(nbytes)

    def copy(self, dst, src):
        self.sim.copy_async(dst, src)

    def record_stream(self, t, stream):
        self.sim.record_stream(t, stream)

    def register_host(self, ptr, nbytes):
        return self.sim.register_host(ptr, nbytes)

    def synchronize(self):
        self.sim.synchronize()


class CudaSim:
    """See the module docstring. `scheduler`: ``lazy``, ``eager`` or ``random``
    (with `seed`); `capacity`: device bytes."""

    def __init__(self, scheduler="lazy", seed=0, capacity=256 << 20):
        if scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {scheduler!r}")
        self.scheduler = scheduler
        self.seed = seed
        self.rng = random.Random(seed)
        self.streams = []
        self.default = self.new_stream("default")
        self.current = self.default
        self.host_vc = {"host": 0}
        self.accesses = Accesses()
        self.alloc = SimAllocator(self, capacity)
        self.host_regions = []  # sorted (start, end) of pinned host memory
        self.keep_pinned = []
        self.dev_rng_state = torch.Generator().manual_seed(seed + 1).get_state()
        self.late_hazards = []
        self.counters = collections.Counter()
        self._modes = []
        self._patches = []
        self._prev_factory = None

    # -- streams and the scheduler ----------------------------------------------------------
    def new_stream(self, name):
        s = SimStream(self, f"{name}{len(self.streams)}")
        self.streams.append(s)
        return s

    def event(self):
        return SimEvent(self)

    @contextlib.contextmanager
    def stream(self, s):
        prev, self.current = self.current, s
        try:
            yield s
        finally:
            self.current = prev

    def host_observe(self, vc):
        self.host_vc = _joined(self.host_vc, vc)

    def host_wait(self, stream, seq):
        if stream.done_seq < seq:
            self.counters["blocking_waits"] += 1
            self.run_to(stream, seq)
        self.host_observe({stream.name: seq})

    def synchronize(self):
        for s in self.streams:
            s.synchronize()

    def run_to(self, stream, seq, depth=0):
        if depth > 64:
            raise Deadlock(f"{stream} cannot reach {seq}")
        while stream.done_seq < seq:
            kind, payload, s = stream.queue[0]
            if kind == "wait" and payload[0].done_seq < payload[1]:
                self.run_to(payload[0], payload[1], depth + 1)
                continue
            self._execute(stream)

    def _runnable(self, s):
        if not s.queue:
            return False
        kind, payload, _ = s.queue[0]
        return kind != "wait" or payload[0].done_seq >= payload[1]

    def _execute(self, stream):
        kind, payload, seq = stream.queue.popleft()
        if kind == "copy":
            dst, src, n = payload
            ctypes.memmove(dst, src, n)
        elif kind == "poison":
            ctypes.memset(payload[0], 0xFF, payload[1])
        stream.done_seq = seq

    def after_call(self):
        """Let the GPU make progress as the scheduler says."""
        self.raise_late()
        if self.scheduler == "eager":
            while self._step_any():
                pass
        elif self.scheduler == "random":
            for _ in range(self.rng.randint(0, 3)):
                if not self._step_any():
                    break

    def _step_any(self):
        ready = [s for s in self.streams if self._runnable(s)]
        if not ready:
            return False
        self._execute(self.rng.choice(ready) if self.scheduler == "random" else ready[0])
        return True

    def raise_late(self):
        if self.late_hazards:
            msg = self.late_hazards.pop(0)
            raise Hazard(msg)

    @contextlib.contextmanager
    def device_rng(self):
        """Random numbers drawn inside come from the device's generator; the
        host's stream does not move (CUDA's generator is a separate one)."""
        host = torch.get_rng_state()
        torch.set_rng_state(self.dev_rng_state)
        try:
            yield
        finally:
            self.dev_rng_state = torch.get_rng_state()
            torch.set_rng_state(host)

    # -- memory ------------------------------------------------------------------------------
    def is_device(self, t):
        try:
            return bool(getattr(t.untyped_storage(), "_sim_dev", False))
        except (RuntimeError, NotImplementedError):
            return False

    def empty(self, numel, dtype, stream=None):
        """A device tensor of `numel` elements from the arena, poisoned, allocated on `stream`."""
        stream = stream or self.current
        itemsize = torch.empty(0, dtype=dtype).element_size()
        nbytes = numel * itemsize
        if nbytes == 0:
            t = torch.empty(0, dtype=dtype, device="cpu")
            t.untyped_storage()._sim_dev = True
            return t
        off, size = self.alloc.alloc(nbytes, stream)
        addr = self.alloc.base + off
        arr = (ctypes.c_char * size).from_address(addr)
        arr._keep = self.alloc.arena  # type: ignore[attr-defined]
        block = torch.frombuffer(arr, dtype=torch.uint8)
        st = block.untyped_storage()
        st._sim_dev = True
        st._sim_used_on = set()
        weakref.finalize(st, self._free_block, off, size, stream, st._sim_used_on)
        seq, vc = stream._enqueue("poison", (addr, size))
        self.accesses.access(addr, addr + size, True, stream.name, seq, vc, "new block poisoned")
        self.after_call()
        return block[:nbytes].view(dtype)

    def resizable(self, numel, dtype):
        """A device tensor of `numel` elements whose storage may be
        ``resize_``-d to 0 and back (see the module docstring); allocated on
        the current stream."""
        t = torch.empty(0, dtype=dtype)
        st = t.untyped_storage()
        st._sim_dev = True
        st._sim_resizable = True
        st.resize_(numel * t.element_size())
        return t.set_(st, 0, (numel,))

    def adopt(self, t):
        """Treat host tensor `t`'s storage as a :meth:`resizable` device
        storage allocated on the current stream (e.g. FSDP2's shards, made on
        the CPU, then run through code that expects them on a GPU)."""
        st = t.untyped_storage()
        st._sim_dev = st._sim_resizable = True
        st._sim_alloc_on, st._sim_used_on = self.current, set()
        return t

    def _resize(self, orig, st, nbytes):
        """``UntypedStorage.resize_`` for :meth:`resizable` storages: an allocation or a free."""
        if not getattr(st, "_sim_resizable", False):
            return orig(st, nbytes)
        old = st.nbytes()
        if old and nbytes and old != nbytes:
            raise NotImplementedError("the simulator resizes device storages to 0 and back only")
        if old and not nbytes:
            self._free_resizable(st, st.data_ptr(), st.data_ptr() + old)
        out = orig(st, nbytes)
        if nbytes and not old:
            s = self.current
            lo = st.data_ptr()
            st._sim_alloc_on, st._sim_used_on = s, set()
            seq, vc = s._enqueue("poison", (lo, nbytes))
            self.accesses.access(lo, lo + nbytes, True, s.name, seq, vc, "storage allocated (resize_)")
            self.after_call()
        return out

    def _free_resizable(self, st, lo, hi):
        alloc = st._sim_alloc_on
        skip = {"host", alloc.name, *(s.name for s in st._sim_used_on)}
        r = self.accesses.unordered(lo, hi, _joined(alloc.vc, self.host_vc), skip)
        if r is not None:
            raise Hazard(
                f"device storage [{lo:#x}, {hi:#x}) freed (resize_(0)) while {r.what} on {r.actor} is not "
                f"ordered before its allocating stream {alloc.name} nor the host: the caching allocator may "
                f"hand the block to {alloc.name}'s next allocation at once\n--- that access:\n"
                f"{_format(r.stack)}--- the free:\n{_format(_stack())}"
            )
        # Its bytes go back to the host's allocator: what is queued on them runs first.
        for s in self.streams:
            last = [
                seq for kind, p, seq in s.queue if kind in ("copy", "poison") and _touches(p, kind, lo, hi)
            ]
            if last:
                self.run_to(s, max(last))
        self.accesses.forget(lo, hi)

    def _free_block(self, off, size, stream, used_on):
        self.alloc.free(off, size, stream, used_on)

    def record_stream(self, t, stream):
        used = getattr(t.untyped_storage(), "_sim_used_on", None)
        if used is not None:
            used.add(stream)

    def pinned(self, nbytes):
        """Page-locked host memory (registered as such)."""
        t = torch.empty(nbytes, dtype=torch.uint8)
        self.keep_pinned.append(t)
        self._add_region(t.data_ptr(), nbytes)
        return t

    def register_host(self, ptr, nbytes):
        """cudaHostRegister: `ptr` counts as pinned until the returned callable runs."""
        self._add_region(ptr, nbytes)
        return lambda: self._drop_region(ptr, nbytes)

    def _add_region(self, ptr, nbytes):
        bisect.insort(self.host_regions, (ptr, ptr + nbytes))

    def _drop_region(self, ptr, nbytes):
        self.host_regions.remove((ptr, ptr + nbytes))
        self.accesses.forget(ptr, ptr + nbytes)

    def is_pinned_ptr(self, lo, hi):
        i = bisect.bisect_right(self.host_regions, (lo, float("inf"))) - 1
        return i >= 0 and self.host_regions[i][0] <= lo and hi <= self.host_regions[i][1]

    def host_access(self, t, write, what):
        """Record a host access to `t` if it lies in pinned memory."""
        lo, hi = _span(t)
        if hi > lo and self.is_pinned_ptr(lo, hi):
            self.host_vc["host"] += 1
            self.accesses.access(lo, hi, write, "host", self.host_vc["host"], self.host_vc, what)

    def poison_host(self, t, what):
        """A recycled host region: the host writes it (hazard check) and it becomes 0xFF."""
        self.host_access(t, True, what)
        lo, hi = _span(t)
        ctypes.memset(lo, 0xFF, hi - lo)

    # -- copies ------------------------------------------------------------------------------
    def copy_async(self, dst, src):
        """``dst.copy_(src, non_blocking=True)`` on the current stream, queued by address."""
        if dst.nbytes != src.nbytes or not (dst.is_contiguous() and src.is_contiguous()):
            raise ValueError("simulated copies take contiguous tensors of equal size")
        s = self.current
        n = dst.nbytes
        d_dev, s_dev = self.is_device(dst), self.is_device(src)
        pageable = (not d_dev and not self.is_pinned_ptr(*_span(dst))) or (
            not s_dev and not self.is_pinned_ptr(*_span(src))
        )
        if pageable:
            self.counters["pageable_h2d" if d_dev else "pageable_d2h"] += 1
        self.counters["copies"] += 1
        seq, vc = s._enqueue("copy", (dst.data_ptr(), src.data_ptr(), n))
        self._copy_access(src, False, s, seq, vc, "copy reads")
        self._copy_access(dst, True, s, seq, vc, "copy writes")
        if pageable:
            # Staged through the driver: the call returns once the pageable
            # side is read (H2D) or written (D2H); the host sees the device
            # side complete only for D2H (CUDA's documented behaviour).
            self.run_to(s, seq)
            if not d_dev:
                self.host_observe({s.name: seq})
        self.after_call()

    def _copy_access(self, t, write, s, seq, vc, what):
        lo, hi = _span(t)
        if self.is_device(t) or self.is_pinned_ptr(lo, hi):
            self.accesses.access(lo, hi, write, s.name, seq, vc, what)
        if self.is_device(t) and not self.alloc.contains(lo):
            self._watch(t.untyped_storage(), lo, hi)

    def _watch(self, storage, lo, hi):
        if getattr(storage, "_sim_watched", False):
            return
        storage._sim_watched = True
        weakref.finalize(storage, self._storage_died, lo, hi)

    def _storage_died(self, lo, hi):
        for s in self.streams:
            for i, (kind, payload, seq) in enumerate(s.queue):
                if kind == "copy" and (
                    payload[0] < hi
                    and lo < payload[0] + payload[2]
                    or payload[1] < hi
                    and lo < payload[1] + payload[2]
                ):
                    self.late_hazards.append(
                        f"device memory [{lo:#x}, {hi:#x}) freed while {s} still has a copy of it queued"
                    )
                    s.queue[i] = ("poison", (payload[0], payload[2]), seq)
        self.accesses.forget(lo, hi)

    def to_device(self, t):
        """A device copy of host tensor `t` (a blocking copy on the current stream)."""
        out = self.empty(t.numel(), t.dtype)
        out.copy_(t.detach().reshape(-1))  # a kernel on the current stream (dispatch mode)
        self.counters["user_h2d"] += 1
        return out.view(t.shape)

    def to_host(self, t):
        """A host copy of device tensor `t`, after the current stream (blocking)."""
        out = torch.empty(t.shape, dtype=t.dtype)
        out.copy_(t)  # the dispatch mode's device-to-host copy: waits for the stream
        return out

    def kernel_reads(self, tensors, what):
        s = self.current
        self._force_deps(s)
        seq, vc = s._enqueue("kernel")
        for t in tensors:
            lo, hi = _span(t)
            self.accesses.access(lo, hi, False, s.name, seq, vc, what)
        return seq, vc

    def _force_deps(self, s):
        """A kernel runs at once on the host: every op it is ordered after must
        have run first (its own stream's copies and poison included)."""
        last_data = max((seq for kind, _, seq in s.queue if kind in ("copy", "poison")), default=0)
        if last_data:
            self.run_to(s, last_data)
        for other in self.streams:
            if other is not s and s.vc.get(other.name, 0) > other.done_seq:
                self.run_to(other, s.vc[other.name])

    # -- activation ------------------------------------------------------------------------------
    def __enter__(self):
        self._prev_factory = streams.set_backend_factory("cuda", lambda device: SimBackend(self, device))
        self._patch_recycling()
        fm, dm = _FunctionMode(self), _DispatchMode(self)
        fm.__enter__()
        dm.__enter__()
        self._modes = [dm, fm]
        return self

    def __exit__(self, *exc):
        for m in self._modes:
            m.__exit__(None, None, None)
        self._modes = []
        for obj, name, orig in reversed(self._patches):
            setattr(obj, name, orig)
        self._patches = []
        streams.set_backend_factory("cuda", self._prev_factory)
        if exc[0] is None:
            self.synchronize()
            self.raise_late()

    def _patch(self, obj, name, new):
        self._patches.append((obj, name, getattr(obj, name)))
        setattr(obj, name, new)

    def _patch_recycling(self):
        sim = self
        take = streams.PinnedRing.take
        acquire = aio.pinned.PinnedPool.acquire

        def ring_take(ring, nbytes):
            region = take(ring, nbytes)
            if region is not None:
                sim.poison_host(region, "staging region taken again")
            return region

        def pool_acquire(pool, timeout=None):
            lease = acquire(pool, timeout)
            sim.poison_host(lease.tensor(torch.uint8), "swap buffer leased again")
            return lease

        resize = torch.UntypedStorage.resize_
        self._patch(torch.UntypedStorage, "resize_", lambda st, nbytes: sim._resize(resize, st, nbytes))
        self._patch(streams.PinnedRing, "take", ring_take)
        self._patch(aio.pinned.PinnedPool, "acquire", pool_acquire)

    def stats(self):
        keys = ("pageable_h2d", "pageable_d2h", "blocking_waits", "copies", "user_h2d")
        return {"peak_device_bytes": self.alloc.peak, **{k: self.counters[k] for k in keys}}


def _touches(payload, kind, lo, hi):
    if kind == "poison":
        return payload[0] < hi and lo < payload[0] + payload[1]
    dst, src, n = payload
    return dst < hi and lo < dst + n or src < hi and lo < src + n


def _span(t):
    if t.numel() == 0:
        return 0, 0
    lo = t.data_ptr()
    return lo, lo + _extent(t)


def _extent(t):
    if t.is_contiguous():
        return t.numel() * t.element_size()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


def _is_view_op(func):
    rets = func._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def _written_args(func, args, kwargs):
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(v, torch.Tensor):
                out.append(v)
    return out


class _DispatchMode(TorchDispatchMode):
    """Kernels: aten ops that touch device tensors run on the current stream."""

    def __init__(self, sim):
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sim = self.sim
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        dev = [t for t in tensors if sim.is_device(t)]
        if not dev:
            return self._host_op(func, args, kwargs, tensors)
        if func is torch.ops.aten.copy_.default and not sim.is_device(args[0]):
            return self._to_host_copy(func, args, kwargs)
        host = [t for t in tensors if not sim.is_device(t) and t.dim() > 0]
        if host and func is not torch.ops.aten.copy_.default:
            raise RuntimeError(
                "Expected all tensors to be on the same device, but found at least two devices, "
                f"cuda:0 and cpu! (simulated CUDA, in {func})"
            )
        if _is_view_op(func) or func is torch.ops.aten.set_.source_Storage_storage_offset:
            return func(*args, **kwargs)
        return self._kernel(func, args, kwargs, tensors)

    def _host_op(self, func, args, kwargs, tensors):
        sim = self.sim
        if sim.host_regions and not _is_view_op(func):
            written = _written_args(func, args, kwargs)
            for t in tensors:
                sim.host_access(t, any(t is w for w in written), f"host {func}")
        return func(*args, **kwargs)

    def _to_host_copy(self, func, args, kwargs):
        sim = self.sim
        sim.kernel_reads([args[1]], "copy to host")
        sim.host_wait(sim.current, sim.current.vc[sim.current.name])
        sim.host_access(args[0], True, "copy to host lands")
        return func(*args, **kwargs)

    def _kernel(self, func, args, kwargs, tensors):
        sim = self.sim
        s = sim.current
        sim._force_deps(s)
        seq, vc = s._enqueue("kernel")
        written = _written_args(func, args, kwargs)
        for t in tensors:
            w = any(t is x for x in written)
            if sim.is_device(t):
                lo, hi = _span(t)
                sim.accesses.access(lo, hi, w, s.name, seq, vc, f"kernel {func}")
            else:
                sim.host_access(t, w, f"kernel {func} (host operand)")
        if torch.Tag.nondeterministic_seeded in func.tags:
            out = self._device_random(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        self._tag_outputs(out, s, seq, vc, func)
        if not isinstance(out, (torch.Tensor, tuple, list)):  # .item(), equal(): the host waits
            sim.host_wait(s, seq)
        sim.after_call()
        return out

    def _device_random(self, func, args, kwargs):
        with self.sim.device_rng():
            return func(*args, **kwargs)

    def _tag_outputs(self, out, s, seq, vc, func):
        sim = self.sim
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                st = t.untyped_storage()
                if not getattr(st, "_sim_dev", False):
                    st._sim_dev = True
                    lo, hi = _span(t)
                    sim.accesses.access(lo, hi, True, s.name, seq, vc, f"kernel {func} output")
                    if t.numel():
                        sim._watch(st, lo, hi)


def _getter_name(func):
    name = getattr(func, "__name__", "")
    owner = getattr(func, "__self__", None)
    if name == "__get__" and owner is not None and hasattr(owner, "__name__"):
        return owner.__name__
    return name


class _FunctionMode(TorchFunctionMode):
    """``device="cuda"`` on a CPU-only torch: factories, ``.to``/``.cuda``/``.cpu``,
    ``.device``/``.is_cuda``/``is_pinned()``, ``pin_memory=True``."""

    def __init__(self, sim):
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sim = self.sim
        name = _getter_name(func)
        if (
            name in ("device", "is_cuda", "get_device", "is_pinned")
            and args
            and isinstance(args[0], torch.Tensor)
        ):
            return self._ask(name, args[0], func, args, kwargs)
        if name in ("to", "cuda", "cpu") and args and isinstance(args[0], torch.Tensor):
            return self._move(name, func, args, kwargs)
        if name == "pin_memory" and args and isinstance(args[0], torch.Tensor):
            return sim_pin(sim, args[0])
        dev = kwargs.get("device")
        if dev is not None and torch.device(dev).type == "cuda":
            kwargs = dict(kwargs, device="cpu")
            out = self._random_or(func, args, kwargs)
            return tree_map(lambda t: sim.to_device(t) if isinstance(t, torch.Tensor) else t, out)
        if kwargs.get("pin_memory"):
            out = func(*args, **dict(kwargs, pin_memory=False))
            if out.nbytes:
                sim._add_region(out.data_ptr(), out.nbytes)
            sim.keep_pinned.append(out)
            return out
        return func(*args, **kwargs)

    def _random_or(self, func, args, kwargs):
        if getattr(func, "__name__", "") in ("randn", "rand", "randint", "randperm", "normal", "randn_like"):
            with self.sim.device_rng():
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    def _ask(self, name, t, func, args, kwargs):
        d = self.sim.is_device(t)
        if name == "device":
            return DEVICE if d else func(*args, **kwargs)
        if name == "is_cuda":
            return d
        if name == "get_device":
            return 0 if d else -1
        lo, hi = _span(t)
        return (not d) and hi > lo and self.sim.is_pinned_ptr(lo, hi)

    def _move(self, name, func, args, kwargs):
        sim, t = self.sim, args[0]
        if name == "cuda":
            target = DEVICE
        elif name == "cpu":
            target = torch.device("cpu")
        else:
            parse = {k: v for k, v in kwargs.items() if k != "copy"}
            target = torch._C._nn._parse_to(*args[1:], **parse)[0]
        if target is None:
            return func(*args, **kwargs)
        rest = {k: v for k, v in kwargs.items() if k not in ("device", "non_blocking", "copy")}
        if name == "to" and any(isinstance(a, torch.dtype) for a in args[1:]) or "dtype" in rest:
            dtype = next((a for a in args[1:] if isinstance(a, torch.dtype)), rest.get("dtype"))
            t = t.to(dtype)
        if target.type == "cuda":
            return t if sim.is_device(t) else sim.to_device(t)
        return sim.to_host(t) if sim.is_device(t) else t


def sim_pin(sim, t):
    out = torch.empty_like(t)
    out.copy_(t)
    sim._add_region(out.data_ptr(), out.nbytes)
    sim.keep_pinned.append(out)
    return out
