"""OptimizerCheckpointer: an OptimizerSwapper's state as a checkpoint folder.

The folder holds ``subgroup_<i>.bin`` per sub-group (its extent after the
gradient: master weights, then each optimizer state, as the drive holds
them), ``scalars.pt`` (scalar state and the param groups' hyper-parameters)
and ``manifest.json`` (layout, step count, a CRC32 per sub-group), created
atomically (:func:`aio.swap.storage.checkpoint_dir`). The bytes go drive to
drive through the swapper's free buffers (:mod:`aio.swap.copy`). Used through
:meth:`OptimizerSwapper.export_checkpoint`, ``verify_checkpoint``,
``apply_checkpoint`` and ``import_checkpoint``, which check first that the
swapper is open (and, to export, not broken).
"""

from __future__ import annotations

import functools
import json
import os
from typing import TYPE_CHECKING, Any

from .._args import mismatched
from .copy import Chunk
from .param import SwapStateError
from .storage import checkpoint_dir, load_plain, require_complete, save_plain, write_manifest

if TYPE_CHECKING:
    from .optimizer import OptimizerSwapper
    from .subgroup import SubGroup

CHECKPOINT_VERSION = 1


class OptimizerCheckpointer:
    """Exports, verifies and applies checkpoints of `sw`'s swapped state
    (every sub-group's master weights, optimizer states and scalars). Needs
    the master weights on the drive (``sw.master_slot()``): ValueError
    otherwise."""

    def __init__(self, sw: OptimizerSwapper) -> None:
        self.sw = sw
        self._zeros: Any = None  # _zero_bytes()'s zeros (a checkpoint before a sub-group's first step)

    def export(self, directory: str) -> None:
        """Write every sub-group's master weights and optimizer state, plus a
        manifest with checksums, to `directory` (created atomically: a crash
        leaves no half-written checkpoint under that name)."""
        sw = self.sw
        self._check_checkpointable()
        sw.drop_cached()  # the drive copy must be current
        for i, g in sorted(sw.groups.items()):
            if g.master_source is not None and g.valid:  # never stepped: store them first
                sw.update_master(i, lambda master: None)
        torn = [i for i in sorted(sw.groups) if not sw.groups[i].valid]
        if torn:
            raise SwapStateError(
                f"sub-groups {torn} have no complete state on the drive (never initialized, or a "
                "write failed): refusing to save a checkpoint of them; load one first"
            )
        with checkpoint_dir(directory) as tmp:
            manifest: dict[str, Any] = {
                "version": CHECKPOINT_VERSION,
                "optimizer": f"{sw.optimizer_cls.__module__}.{sw.optimizer_cls.__qualname__}",
                "spec": [[n, str(d)] for n, d in sw.spec],
                "state_dtype": sw.state_dtype,
                "steps": sw.steps,
                "groups": {},
            }
            scalars = {}
            chunks = []
            for i in sorted(sw.groups):
                sw.groups[i].settle_grad()
                path = os.path.join(tmp, f"subgroup_{i}.bin")
                chunks += self._chunks(sw.groups[i], path, to_checkpoint=True)
            crcs = sw.copy_through_buffers(chunks)
            for i in sorted(sw.groups):
                g = sw.groups[i]
                manifest["groups"][str(i)] = {
                    "numel": g.numel,
                    "bytes": g.nbytes - g.parts["param"][0],
                    "crc32": crcs[i],
                }
                scalars[i] = g.scalars
            save_plain(
                {"scalars": scalars, "param_groups": self._param_groups()},
                os.path.join(tmp, "scalars.pt"),
                "the optimizer's scalar state",
            )
            write_manifest(tmp, manifest)

    def verify(self, directory: str) -> dict[str, Any]:
        """Check a checkpoint from export_checkpoint() completely -- completeness
        marker, manifest, layout, every sub-group's checksum, the scalar state --
        without changing anything. Returns what apply_checkpoint() needs. A
        malformed manifest or scalar state is a ValueError naming the folder."""
        sw = self.sw
        self._check_checkpointable()
        require_complete(directory)
        try:
            with open(os.path.join(directory, "manifest.json")) as f:
                manifest = json.load(f)
            self._check_manifest(manifest)
            extra = load_plain(os.path.join(directory, "scalars.pt"))
            self._check_extra(extra)
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"{directory}: not a checkpoint of this optimizer: {e}") from None
        chunks = []
        for i in sorted(sw.groups):
            chunks += self._chunks(
                sw.groups[i], os.path.join(directory, f"subgroup_{i}.bin"), to_checkpoint=None
            )
        self._check_crcs(directory, manifest, sw.copy_through_buffers(chunks))
        return {"manifest": manifest, "extra": extra}

    def apply(self, directory: str, verified: dict[str, Any]) -> None:
        """Load a checkpoint that verify_checkpoint() accepted into the swap
        files. Only an I/O error can still fail here; then the swapper refuses
        further use (and export) until a checkpoint is imported again."""
        sw = self.sw
        self._check_checkpointable()
        manifest, extra = verified["manifest"], verified["extra"]
        try:
            chunks = []
            for i in sorted(sw.groups):
                sw.groups[i].valid, sw.groups[i].master_source = False, None
                path = os.path.join(directory, f"subgroup_{i}.bin")
                chunks += self._chunks(sw.groups[i], path, to_checkpoint=False)
            # The file was verified; a checksum failing now means it changed since.
            self._check_crcs(directory, manifest, sw.copy_through_buffers(chunks))
            for g in sw.groups.values():
                g.valid = True
        except BaseException as e:
            sw.broken = (
                f"importing checkpoint {directory} failed part-way ({type(e).__name__}: {e}); the "
                "swapped optimizer state is a mix. Import a checkpoint again"
            )
            raise
        for i, g in sw.groups.items():
            g.scalars = extra["scalars"][i]
        sw.ensure_optimizer()
        for pg, saved in zip(sw.optimizer.param_groups, extra["param_groups"], strict=False):
            pg.update(saved)
        sw.steps = manifest["steps"]
        sw.broken = None

    def _check_checkpointable(self) -> None:
        if not self.sw.master_slot():
            raise ValueError(
                "this swapper keeps no master weights on the drive (master_slot() is False), so its "
                "checkpoint would not hold them: save the optimizer's state with the model's weights "
                "(NVMeAdamW: state_dict())"
            )

    def _param_groups(self) -> list[dict[str, Any]]:
        sw = self.sw
        if sw.optimizer is None:
            return []
        return [{k: v for k, v in pg.items() if k != "params"} for pg in sw.optimizer.param_groups]

    def _check_manifest(self, manifest: Any) -> None:
        """ValueError (or KeyError/TypeError on a malformed one) unless the
        manifest describes this swapper's state layout and sub-groups."""
        sw = self.sw
        if not isinstance(manifest, dict):
            raise ValueError("manifest.json does not hold an object")
        if manifest.get("version") != CHECKPOINT_VERSION:
            raise ValueError(f"unsupported checkpoint version {manifest.get('version')!r}")
        spec = [[n, str(d)] for n, d in sw.spec]
        if manifest["spec"] != spec:
            raise ValueError(
                f"checkpoint optimizer state {manifest['spec']} does not match this optimizer's {spec}"
            )
        if manifest.get("state_dtype", "fp32") != sw.state_dtype:
            raise ValueError(
                f"checkpoint holds {manifest.get('state_dtype', 'fp32')} optimizer states, this swapper "
                f"stores {sw.state_dtype} (aio_zero.optimizer_states); load it with the same setting"
            )
        groups = manifest["groups"]
        if sorted(int(i) for i in groups) != sorted(sw.groups):
            raise ValueError("checkpoint sub-groups do not match the registered sub-groups")
        if not isinstance(manifest.get("steps"), int) or isinstance(manifest["steps"], bool):
            raise ValueError("the manifest's step count is not an integer")
        for i, g in sw.groups.items():
            meta = groups[str(i)]
            if meta["numel"] != g.numel or meta["bytes"] != g.nbytes - g.parts["param"][0]:
                raise ValueError(f"checkpoint sub-group {i} has a different size")
            if not isinstance(meta["crc32"], int):
                raise ValueError(f"checkpoint sub-group {i} has no integer checksum")

    def _check_extra(self, extra: Any) -> None:
        """ValueError unless scalars.pt holds, for every sub-group, None (never
        stepped) or its optimizer's scalar entries (tensors or numbers, no state
        tensor's name), and one dict of hyper-parameters per param group, each
        of the kind the optimizer's own has (a number where it has a number)."""
        import torch

        sw = self.sw
        if (
            not isinstance(extra, dict)
            or not isinstance(extra.get("scalars"), dict)
            or set(extra["scalars"]) != set(sw.groups)
        ):
            raise ValueError("scalars.pt does not describe these sub-groups")
        states = {n for n, _ in sw.spec} | {"param"}
        for i, sc in extra["scalars"].items():
            ok = sc is None or (
                isinstance(sc, dict)
                and all(isinstance(k, str) and k not in states for k in sc)
                and all(torch.is_tensor(v) or isinstance(v, (int, float)) for v in sc.values())
            )
            if not ok:
                raise ValueError(
                    f"scalars.pt: sub-group {i}'s scalar state is not tensors or numbers by name"
                )
        saved = extra.get("param_groups")
        if not isinstance(saved, list) or not all(isinstance(g, dict) and "params" not in g for g in saved):
            raise ValueError("scalars.pt: the param groups' hyper-parameters are not dicts of values")
        # The optimizer's groups, or (not made yet) the hyper-parameters it will be made with.
        current = sw.optimizer.param_groups if sw.optimizer is not None else [sw.hyper] * len(saved)
        if saved and len(saved) != len(current):
            raise ValueError(
                f"scalars.pt has hyper-parameters for {len(saved)} param groups, not {len(current)}"
            )
        for k, (now, got) in enumerate(zip(current, saved, strict=False)):
            if bad := mismatched(now, got):
                key = bad[0]
                raise ValueError(
                    f"scalars.pt: param group {k}'s {key!r} is {got[key]!r}, not like {now[key]!r}"
                )

    def _chunks(self, g: SubGroup, path: str, to_checkpoint: bool | None) -> list[Chunk]:
        """The copy of sub-group `g`'s saved tensors (master weights, then the
        states: the checkpoint file is its extent after the gradient) from
        the swap space to the checkpoint file `path` (to_checkpoint True),
        back (False), or only read from the file (None: a verify pass)."""
        sw = self.sw
        base = g.offset + g.parts["param"][0]
        handle = sw.space.handle
        out = []
        for name in sw.saved_parts():
            off, n = g.part_io(name)
            at = off - base
            if to_checkpoint:
                if name != "param" and g.scalars is None:  # never stepped: zeros set-up did not write
                    c = Chunk(n, g.index, data=self._zero_bytes(n))
                else:
                    c = Chunk(n, g.index, read=functools.partial(sw.space.read, offset=off))
                c.write = functools.partial(handle.async_pwrite, path=path, file_offset=at)
            else:
                c = Chunk(n, g.index, read=functools.partial(handle.async_pread, path=path, file_offset=at))
                if to_checkpoint is False:
                    c.write = functools.partial(sw.space.write, offset=off)
            out.append(c)
        return out

    def _zero_bytes(self, n: int) -> Any:
        """A view of `n` zero bytes, shared by every chunk of a checkpoint."""
        import torch

        if self._zeros is None or self._zeros.numel() < n:
            self._zeros = torch.zeros(n, dtype=torch.uint8)
        return self._zeros[:n]

    def _check_crcs(self, directory: str, manifest: dict[str, Any], crcs: dict[Any, int]) -> None:
        for i in sorted(self.sw.groups):
            if crcs[i] != manifest["groups"][str(i)]["crc32"]:
                raise OSError(5, f"checkpoint sub-group {i} fails its checksum", directory)
