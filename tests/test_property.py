"""Property-based: random size, offset and settings against a byte-array model."""

import os

import numpy as np
from conftest import engine_unavailable
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aio

FILE_SIZE = 3 << 20
# io_uring joins where its runtime probe passes (hypothesis cannot skip one value).
PROPERTY_ENGINES = ["kernel_aio", "posix"] + ([] if engine_unavailable("io_uring") else ["io_uring"])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(
        st.tuples(
            st.integers(0, FILE_SIZE - 1),  # offset
            st.integers(0, 1 << 20),  # size
            st.integers(0, 4096),  # memory misalignment
        ),
        min_size=1,
        max_size=4,
    ),
    engine=st.sampled_from(PROPERTY_ENGINES),
    block_size=st.sampled_from([4096, 8192, 65536, 1 << 20, 12288 + 512]),
    queue_depth=st.integers(1, 16),
    thread_count=st.integers(1, 4),
    single_submit=st.booleans(),
    overlap_events=st.booleans(),
    use_async=st.booleans(),
)
def test_random_writes_match_model(
    tmp_path,
    ops,
    engine,
    block_size,
    queue_depth,
    thread_count,
    single_submit,
    overlap_events,
    use_async,
):
    path = str(tmp_path / f"prop{os.getpid()}.bin")
    rng = np.random.default_rng(len(ops) * 7919 + block_size)
    model = rng.integers(0, 256, FILE_SIZE, dtype=np.uint8)
    model.tofile(path)
    h = aio.AsyncIOHandle(
        block_size=block_size,
        queue_depth=queue_depth,
        thread_count=thread_count,
        single_submit=single_submit,
        overlap_events=overlap_events,
        engine=engine,
    )
    for off, n, mis in ops:
        n = min(n, FILE_SIZE - off)
        raw = np.empty(n + mis + 1, np.uint8)
        src = raw[mis : mis + n]
        src[:] = rng.integers(0, 256, n, dtype=np.uint8)
        if use_async:
            h.async_pwrite(src, path, off).result()
        else:
            h.sync_pwrite(src, path, off)
        model[off : off + n] = src
        out = np.empty(n, np.uint8)
        h.sync_pread(out, path, off)
        assert np.array_equal(out, src)
    assert h.wait() == (len(ops) if use_async else 0)
    assert np.array_equal(np.fromfile(path, np.uint8), model)
