import warnings

import pytest

from . import ds_op


@pytest.fixture(scope="session")
def ds_op_dir():
    """A function of a DeepSpeed accelerator name ("cpu", "cuda"): the
    TORCH_EXTENSIONS_DIR holding DeepSpeed's own async_io op built for it
    (see ds_op.py); it skips the calling test when the op is not ready. The
    answer, a skip too, holds for the session: one build attempt at most."""
    answers: dict[str, tuple[str | None, str]] = {}

    def get(accelerator: str) -> str:
        if accelerator not in answers:
            answers[accelerator] = _ready(accelerator)
        folder, skip_reason = answers[accelerator]
        if folder is None:
            pytest.skip(skip_reason)
        return folder

    return get


def _ready(accelerator: str) -> tuple[str | None, str]:
    reason = ds_op.unbuildable_reason()
    if reason is not None:
        return None, reason
    try:
        folder, seconds, built = ds_op.prepare(accelerator, ds_op.build_budget_s())
    except pytest.skip.Exception as e:
        return None, str(e)
    if built:  # the build's time, in pytest's warnings summary (also from xdist workers)
        warnings.warn(
            f"built DeepSpeed's async_io op ({accelerator}) in {seconds:.0f} s into {folder}", stacklevel=1
        )
    return folder, ""
