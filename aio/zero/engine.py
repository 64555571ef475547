"""The offload training engine: a plain PyTorch model trained with its
parameters and optimizer state on the drive (or in CPU memory).

Per step: forward/backward fetch each module's parameters just before use
(hooks.Fetcher); each parameter's gradient is added, in fp32, into its
sub-group's gradient buffer as soon as autograd has it and the buffer is
written to the drive when the sub-group is complete; ``step()`` runs the
optimizer sub-group by sub-group through the (pipelined) optimizer swapper,
applying gradient clipping / loss-scale removal on the way, and writes the
updated low-precision parameters back.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

from ..config import ConfigError
from ..handle import AioFuture
from ..pinned import Lease
from ..swap import OptimizerSwapper
from ..swap.storage import checkpoint_dir
from .config import TrainConfig, check_drive_paths, load_train_config
from .hooks import Fetcher
from .linear import install_linear, saved_tensor_guard
from .optim import MemoryOptimizer
from .params import ParamStore, check_fits, trim_malloc
from .scaler import LossScaler

ENGINE_CHECKPOINT_VERSION = 1


def initialize(model: Any, config: Any, optimizer: Any = None, device: Any = None) -> Engine:
    """Wrap `model` for offloaded training.

    `config`: a DeepSpeed-format dict or JSON path (see docs/zero.md).
    `optimizer`: a torch optimizer instance (its class and hyper-parameters
    are used; it is never stepped itself), a torch optimizer class (with
    ``optimizer.params`` from the config), or None (``optimizer.type`` from
    the config). Every config problem is raised before anything is allocated.
    """
    return Engine(model, config, optimizer=optimizer, device=device)


def _resolve_optimizer(cfg: TrainConfig, optimizer: Any) -> tuple[Any, dict[str, Any]]:
    import torch

    if optimizer is None:
        if cfg.optimizer_type is None:
            raise ConfigError(
                [("optimizer", "no optimizer: pass optimizer= or set optimizer.type in the config")]
            )
        return cfg.optimizer_class(), dict(cfg.optimizer_params)
    if isinstance(optimizer, torch.optim.Optimizer):
        if len(optimizer.param_groups) != 1:
            raise ValueError(
                "aio.zero steps the whole model as one parameter group; the optimizer has "
                f"{len(optimizer.param_groups)} groups (per-group settings are not supported)"
            )
        import inspect

        accepted = inspect.signature(type(optimizer).__init__).parameters
        hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params" and k in accepted}
        if cfg.optimizer_type is not None:
            warnings.warn(
                "both optimizer= and a config 'optimizer' block given; using optimizer=", stacklevel=3
            )
        return type(optimizer), hyper
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return optimizer, dict(cfg.optimizer_params)
    raise TypeError(
        f"optimizer must be a torch.optim.Optimizer instance or class, got {type(optimizer).__name__}"
    )


class _Slot:
    """Where one parameter's gradient goes: sub-group and element offset."""

    __slots__ = ("param", "group", "offset", "numel", "order")

    def __init__(self, param: Any, group: int, offset: int, numel: int, order: int) -> None:
        self.param, self.group, self.offset, self.numel, self.order = param, group, offset, numel, order


class Engine:
    """See :func:`initialize`. DeepSpeed-style loop::

    for batch in data:
        loss = loss_fn(engine(batch))
        engine.backward(loss)
        engine.step()   # steps the optimizer at accumulation boundaries
    """

    def __init__(self, model: Any, config: Any, optimizer: Any = None, device: Any = None) -> None:
        import torch

        self.closed = True  # until fully built: close() must not touch missing parts
        cfg = load_train_config(config)
        self.cfg = cfg
        self.optimizer_cls, self.hyper = _resolve_optimizer(cfg, optimizer)
        self.module = model
        named = _unique_named_params(model)
        if not named:
            raise ValueError("the model has no parameters")
        store = _existing_store(named)
        if device is None:
            device = store.device if store is not None else _model_device(named)
        self.device = torch.device(device)

        # -- everything checked before any allocation -----------------------------------
        trainable = [(n, p) for n, p in named if p.requires_grad]
        if not trainable:
            raise ValueError("no parameter requires grad: nothing to train")
        sizes = {n: _numel(p) for n, p in named}
        sgs = cfg.sub_group_size
        big = max(trainable, key=lambda np_: sizes[np_[0]])
        if sizes[big[0]] > sgs:
            raise ConfigError(
                [
                    (
                        "zero_optimization.sub_group_size",
                        f"{sgs} elements is smaller than parameter {big[0]!r} ({sizes[big[0]]} "
                        f"elements); set it to at least {sizes[big[0]]}",
                    )
                ]
            )
        if store is not None:
            if store.cfg.offload.offload_param != cfg.offload.offload_param or store.dtype != cfg.torch_dtype:
                raise ConfigError(
                    [
                        (
                            "zero_optimization.offload_param",
                            "the model was built under aio.zero.Init with a different offload_param "
                            "block or dtype than this config; pass the same config to both",
                        )
                    ]
                )
        else:
            for n, _p in named:
                check_fits(cfg, n, sizes[n])
        check_drive_paths(cfg)

        # -- layout: parameters packed into sub-groups in model order -------------------
        self.slots: dict[int, _Slot] = {}
        self.groups: list[list[_Slot]] = []
        self.group_numel: list[int] = []
        cur: list[tuple[str, Any]] = []
        cur_n = 0
        packed: list[list[tuple[str, Any]]] = []
        for n, p in trainable:
            if cur and cur_n + sizes[n] > sgs:
                packed.append(cur)
                cur, cur_n = [], 0
            cur.append((n, p))
            cur_n += sizes[n]
        packed.append(cur)

        # -- allocation ---------------------------------------------------------------------
        self.store = store if store is not None else ParamStore(cfg, self.device)
        self.opt: Any = None
        self.fetcher: Fetcher | None = None
        self._grad_hooks: list[Any] = []
        try:
            for n, p in named:
                self.store.adopt(p, n)
            if cfg.optimizer_device == "nvme":
                self.opt = OptimizerSwapper.from_config(cfg.offload, self.optimizer_cls, self.hyper)
            else:
                self.opt = MemoryOptimizer(self.optimizer_cls, self.hyper)
            order = 0
            for gi, members in enumerate(packed):
                slots = []
                off = 0
                for _n, p in members:
                    s = _Slot(p, gi, off, p.aio_numel, order)
                    order += 1
                    slots.append(s)
                    self.slots[p.aio_id] = s
                    off += p.aio_numel
                self.groups.append(slots)
                self.group_numel.append(off)
                self.opt.register_subgroup(gi, off)
            for gi, slots in enumerate(self.groups):
                master = torch.empty(self.group_numel[gi], dtype=torch.float32)
                for s in slots:
                    master[s.offset : s.offset + s.numel].copy_(self.store.read(s.param))
                self.opt.initialize(gi, master)
                del master
            for s in self.slots.values():
                self._grad_hooks.append(s.param.register_post_accumulate_grad_hook(self._on_grad))
            if self.store.swapper is not None or self.device.type != "cpu":
                install_linear()
                self.fetcher = Fetcher(self.store, list(model.modules()), cfg.prefetch_bucket_size)
        except BaseException:
            self.closed = False
            self.close()
            raise
        self.closed = False
        trim_malloc()
        self.scaler = LossScaler(cfg.loss_scale) if cfg.dtype == "fp16" else None
        self.gas = cfg.gradient_accumulation_steps
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self.abandoned_windows = 0
        # gradient buffers being filled this micro-step: group -> (lease or None, fp32 view)
        self._open: dict[int, tuple[Lease | None, Any]] = {}
        self._arrived: dict[int, int] = {}
        self._touched: set[int] = set()  # groups with a gradient in this micro-step
        self._flushed: set[int] = set()  # groups written part-way through this micro-step
        self._pending: list[tuple[int, Lease, AioFuture]] = []  # gradient writes in flight
        self._norms: dict[int, Any] = {}  # slot order -> grad norm (accumulation boundary)
        self.last_grad_norm: float | None = None
        self._param_writes: list[Any] = []

    # -- the loop --------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_open()
        if self.fetcher is None:
            return self.module(*args, **kwargs)
        self.fetcher.begin_forward()
        with saved_tensor_guard(self.store.buffer_ptrs, self.fetcher.counters):
            return self.module(*args, **kwargs)

    __call__ = forward

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gas == 0

    def backward(self, loss: Any) -> Any:
        """Back-propagate `loss` (scaled by 1/gradient_accumulation_steps, and
        by the loss scale in fp16); gradients go to the sub-group buffers."""
        self._check_open()
        scaled = loss
        if self.scaler is not None:
            scaled = scaled * self.scaler.scale
        if self.gas > 1:
            scaled = scaled / self.gas
        try:
            scaled.backward()
            self._finish_backward()
        except BaseException:
            self._abandon_window()
            raise
        return loss

    def get_lr(self) -> float:
        return float(self.opt.hyper["lr"])

    def set_lr(self, lr: float) -> None:
        """Change the learning rate from the next step on (for a schedule)."""
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr < 0:
            raise ValueError(f"lr must be a number >= 0, got {lr!r}")
        self.opt.hyper["lr"] = lr
        if self.opt.optimizer is not None:
            for pg in self.opt.optimizer.param_groups:
                pg["lr"] = lr

    def zero_grad(self) -> None:
        """Nothing to do: gradients never stay on the parameters (kept for API compatibility)."""

    def _on_grad(self, param: Any) -> None:
        import torch

        g = param.grad
        param.grad = None
        if self.fetcher is not None:
            self.fetcher.release_after_backward(param)
        s = self.slots[param.aio_id]
        buf = self._grad_buffer(s.group)
        view = buf[s.offset : s.offset + s.numel]
        view.add_(
            g.reshape(-1).to(device="cpu", dtype=torch.float32) if g.device.type != "cpu" else g.reshape(-1)
        )
        if self.is_gradient_accumulation_boundary() and (self.cfg.gradient_clipping > 0 or self.scaler):
            self._norms[s.order] = torch.linalg.vector_norm(view)
        self._arrived[s.group] = self._arrived.get(s.group, 0) + 1
        if self._arrived[s.group] == len(self.groups[s.group]):
            self._close_group(s.group)

    def _grad_buffer(self, gi: int) -> Any:
        import torch

        if gi in self._open:
            return self._open[gi][1]
        first_micro = self.micro_steps % self.gas == 0
        resume = not (first_micro and gi not in self._flushed)
        self._touched.add(gi)
        if isinstance(self.opt, MemoryOptimizer):
            buf = self.opt.grads[gi]
            if not resume:
                buf.zero_()
            self._open[gi] = (None, buf)
            return buf
        lease = self._take_lease()
        try:
            buf = lease.tensor(torch.float32, self.group_numel[gi])
            if resume:
                self.opt.read_gradient(gi, buf)
            else:
                buf.zero_()
        except BaseException:
            lease.release()
            raise
        self._open[gi] = (lease, buf)
        return buf

    def _take_lease(self) -> Lease:
        while True:
            lease = self.opt.try_acquire_buffer()
            if lease is not None:
                return lease
            if self._pending:
                self._settle_write(self._pending.pop(0))
            elif self._open:
                # Every buffer holds a partly filled sub-group: write the oldest
                # out; its next gradient reads it back and adds to it.
                gi = next(iter(self._open))
                self._close_group(gi)
                self._flushed.add(gi)
            else:
                return self.opt.acquire_buffer()

    def _close_group(self, gi: int) -> None:
        lease, buf = self._open.pop(gi)
        if lease is not None:
            try:
                fut = self.opt.write_gradient(gi, buf)
            except BaseException:
                lease.release()
                raise
            self._pending.append((gi, lease, fut))

    def _settle_write(self, entry: tuple[int, Lease, AioFuture]) -> None:
        _gi, lease, fut = entry
        try:
            fut.result()
        finally:
            lease.release()

    def _settle_writes(self) -> None:
        first: BaseException | None = None
        while self._pending:
            try:
                self._settle_write(self._pending.pop(0))
            except BaseException as e:  # noqa: BLE001 - every lease back first
                first = first or e
        if first is not None:
            raise first

    def _finish_backward(self) -> None:
        if self.fetcher is not None:
            self.fetcher.end_backward()
        for gi in list(self._open):
            self._close_group(gi)
        if self.micro_steps % self.gas == 0:
            # A sub-group that got no gradient this step still holds the last step's.
            for gi in range(len(self.groups)):
                if gi not in self._touched:
                    self._grad_buffer(gi)
                    self._close_group(gi)
        self._arrived.clear()
        self._flushed.clear()

    def step(self) -> None:
        """End of a micro-step: at an accumulation boundary, one optimizer
        step over every sub-group, then the new parameters are stored."""
        import torch

        self._check_open()
        if self.fetcher is not None:
            self.fetcher.end_backward()
        if self._open:
            self._finish_backward()
        if not self.is_gradient_accumulation_boundary():
            self.micro_steps += 1
            self._touched.clear()
            return
        try:
            self._settle_writes()
        except BaseException:
            self._abandon_window()
            raise
        if not self._touched:
            raise RuntimeError("step() without a backward() since the last step")
        grad_scale = None
        norm = None
        if self._norms:
            norms = [self._norms[k] for k in sorted(self._norms)]
            norm = torch.linalg.vector_norm(torch.stack(norms))
        if self.scaler is not None:
            inv = 1.0 / self.scaler.scale
            overflow = norm is not None and not bool(torch.isfinite(norm))
            self.scaler.update(overflow)
            if overflow:
                self.skipped_steps += 1
                self.last_grad_norm = float("inf")
                self._end_step()
                return
            assert norm is not None
            norm = norm * inv
            grad_scale = torch.tensor(inv, dtype=torch.float32)
        if norm is not None:
            self.last_grad_norm = float(norm)
        if self.cfg.gradient_clipping > 0 and norm is not None:
            coef = torch.clamp(self.cfg.gradient_clipping / (norm + 1e-6), max=1.0)
            grad_scale = coef if grad_scale is None else grad_scale * coef
        self._param_writes = []
        try:
            self.opt.step(after=self._store_params, grad_scale=grad_scale)
        finally:
            self.store.settle(self._param_writes)
            self._param_writes = []
        self.global_steps += 1
        self._end_step()

    def _abandon_window(self) -> None:
        """A backward or a gradient write failed: drop this accumulation
        window's gradients (the optimizer state is untouched), give every
        buffer back and start the window again at the next backward()."""
        self._reset_window()
        self.abandoned_windows += 1

    def _reset_window(self) -> None:
        if self.fetcher is not None:
            self.fetcher.end_backward()
        for lease, _buf in self._open.values():
            if lease is not None:
                lease.release()
        self._open.clear()
        for _gi, lease, fut in self._pending:
            fut.exception()
            lease.release()
        self._pending.clear()
        if isinstance(self.opt, OptimizerSwapper):
            self.opt.discard_gradients()
        self._arrived.clear()
        self._flushed.clear()
        self._touched.clear()
        self._norms.clear()
        self.micro_steps -= self.micro_steps % self.gas
        for s in self.slots.values():
            s.param.grad = None

    def _end_step(self) -> None:
        self._norms.clear()
        self._touched.clear()
        self.micro_steps += 1

    def _store_params(self, gi: int, master: Any) -> None:
        # The previous sub-group's parameter writes had this sub-group's step
        # to land; wait for them now, so at most two sub-groups of parameter
        # copies are ever held (not the whole model until the next forward).
        self.store.settle(self._param_writes)
        self._param_writes = []
        for s in self.groups[gi]:
            self.store.write(s.param, master[s.offset : s.offset + s.numel])
            self._param_writes.append(s.param)

    # -- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None) -> str:
        """Write parameters, optimizer state and counters to ``save_dir/tag``
        (default tag ``global_stepN``), atomically, and point ``save_dir/latest``
        at it. Only between optimizer steps (not mid-accumulation)."""
        import torch

        self._check_open()
        if self.micro_steps % self.gas != 0:
            raise ValueError(
                "save_checkpoint() in the middle of gradient accumulation would lose the partial "
                "gradient; save right after a step() at an accumulation boundary"
            )
        tag = tag or f"global_step{self.global_steps}"
        if not tag or "/" in tag or tag.startswith("."):
            raise ValueError(f"bad checkpoint tag {tag!r}")
        os.makedirs(save_dir, exist_ok=True)
        self.store.synchronize()
        path = os.path.join(save_dir, tag)
        with checkpoint_dir(path) as tmp:
            self.store.export_checkpoint(os.path.join(tmp, "params"))
            self.opt.export_checkpoint(os.path.join(tmp, "optimizer"))
            torch.save(client_state or {}, os.path.join(tmp, "client_state.pt"))
            meta = {
                "version": ENGINE_CHECKPOINT_VERSION,
                "global_steps": self.global_steps,
                "micro_steps": self.micro_steps,
                "skipped_steps": self.skipped_steps,
                "dtype": self.cfg.dtype,
                "optimizer": f"{self.optimizer_cls.__module__}.{self.optimizer_cls.__qualname__}",
                "params": [[s.param.aio_name, list(s.param.aio_shape)] for s in self._ordered_slots()],
                "scaler": self.scaler.state_dict() if self.scaler else None,
            }
            with open(os.path.join(tmp, "engine.json"), "w") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
        latest_tmp = os.path.join(save_dir, f".latest.tmp-{os.getpid()}")
        with open(latest_tmp, "w") as f:
            f.write(tag)
            f.flush()
            os.fsync(f.fileno())
        os.replace(latest_tmp, os.path.join(save_dir, "latest"))
        return path

    def load_checkpoint(self, load_dir: str, tag: str | None = None) -> tuple[str, dict]:
        """Restore a checkpoint from save_checkpoint() (``latest`` when no tag).
        Returns (path, client_state). Checks the model matches before changing anything."""
        import torch

        self._check_open()
        if tag is None:
            latest = os.path.join(load_dir, "latest")
            if not os.path.exists(latest):
                raise FileNotFoundError(2, "no 'latest' file: pass tag= or save a checkpoint first", latest)
            with open(latest) as f:
                tag = f.read().strip()
        path = os.path.join(load_dir, tag)
        with open(os.path.join(path, "engine.json")) as f:
            meta = json.load(f)
        if meta.get("version") != ENGINE_CHECKPOINT_VERSION:
            raise ValueError(f"{path}: unsupported aio.zero checkpoint version {meta.get('version')!r}")
        mine = [[s.param.aio_name, list(s.param.aio_shape)] for s in self._ordered_slots()]
        if meta["params"] != mine:
            raise ValueError(
                f"{path}: the checkpoint's parameters (names and shapes) do not match this model"
            )
        if meta["dtype"] != self.cfg.dtype:
            raise ValueError(f"{path}: saved in {meta['dtype']}, this engine trains in {self.cfg.dtype}")
        self._reset_window()
        self.store.synchronize()
        self.store.import_checkpoint(os.path.join(path, "params"))
        self.opt.import_checkpoint(os.path.join(path, "optimizer"))
        self.global_steps = meta["global_steps"]
        self.micro_steps = meta["micro_steps"]
        self.skipped_steps = meta["skipped_steps"]
        if self.scaler is not None and meta["scaler"]:
            self.scaler.load_state_dict(meta["scaler"])
        client = torch.load(os.path.join(path, "client_state.pt"), weights_only=False)
        return path, client

    def _ordered_slots(self) -> list[_Slot]:
        return sorted(self.slots.values(), key=lambda s: s.order)

    # -- access and accounting -------------------------------------------------------------
    def gathered(self, params: Any = None, modify: bool = False) -> Any:
        """Context manager materialising `params` (default: all) outside
        forward/backward, e.g. to inspect or export weights."""
        if params is None:
            params = list(self.module.parameters())
        return self.store.gathered(list(params), modify=modify)

    def state_dict(self) -> dict[str, Any]:
        """The model's parameters and buffers as CPU tensors, one parameter at a time."""
        out: dict[str, Any] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            out[name] = self.store.read(p).view(p.aio_shape)
        for name, b in self.module.named_buffers():
            out[name] = b.detach().cpu().clone()
        return out

    def pinned_bytes(self) -> int:
        opt = self.opt.pinned_bytes() if self.opt is not None else 0
        return self.store.pinned_bytes() + opt

    def stats(self) -> dict[str, Any]:
        return {
            "global_steps": self.global_steps,
            "micro_steps": self.micro_steps,
            "skipped_steps": self.skipped_steps,
            "abandoned_windows": self.abandoned_windows,
            "loss_scale": self.scaler.scale if self.scaler else None,
            "pinned_bytes": self.pinned_bytes(),
            "params": self.store.stats(),
            "optimizer": self.opt.stats(),
            "fetcher": dict(self.fetcher.counters) if self.fetcher else None,
        }

    def io_bytes(self) -> int:
        """Bytes read and written by the parameter and optimizer swappers so far."""
        total = 0
        if self.store.swapper is not None:
            c = self.store.swapper.counters
            total += c["bytes_read"] + c["bytes_written"]
        if isinstance(self.opt, OptimizerSwapper):
            total += self.opt.counters["bytes_read"] + self.opt.counters["bytes_written"]
        return total

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def parameters(self) -> Any:
        return self.module.parameters()

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("this aio.zero engine is closed")

    def close(self) -> None:
        """Finish I/O, remove hooks and swap files. Parameters become unusable."""
        if self.closed:
            return
        self.closed = True
        for h in self._grad_hooks:
            h.remove()
        if self.fetcher is not None:
            self.fetcher.remove()
        try:
            for _gi, lease, fut in getattr(self, "_pending", []):
                fut.exception()
                lease.release()
        finally:
            if self.opt is not None:
                self.opt.close()
            self.store.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unique_named_params(model: Any) -> list[tuple[str, Any]]:
    out = []
    seen: set[int] = set()
    for n, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append((n, p))
    return out


def _numel(p: Any) -> int:
    return int(getattr(p, "aio_numel", p.numel()))


def _existing_store(named: list[tuple[str, Any]]) -> ParamStore | None:
    stores = {id(s): s for _n, p in named if (s := getattr(p, "_aio_store", None)) is not None}
    if len(stores) > 1:
        raise ValueError("the model's parameters belong to more than one aio.zero.Init store")
    store = next(iter(stores.values()), None)
    if store is not None and store.closed:
        raise ValueError("the model's parameters belong to a closed aio.zero engine or Init")
    return store


def _model_device(named: list[tuple[str, Any]]) -> Any:
    return named[0][1].device
