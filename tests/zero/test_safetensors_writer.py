"""aio/zero/safetensors_writer.py: files safetensors reads, sharded by size,
written whole or not at all, never through a planted link."""

import os

import pytest
import torch
from safetensors.torch import load_file

from aio.zero.safetensors_writer import Source, parse_size, plan_shards, write_shards


def _src(name, t):
    return Source(name, tuple(t.shape), t.dtype, lambda: t)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(3, 5, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).view(2, 3),
        "d": torch.randn(4, 4, generator=g).to(torch.float16),
        "e": torch.zeros(0),
        "f": torch.tensor([True, False]),
    }


def test_one_file_reads_back_exactly(tmp_path):
    ts = _tensors()
    assert write_shards(str(tmp_path), [_src(k, v) for k, v in ts.items()]) == ["model.safetensors"]
    back = load_file(tmp_path / "model.safetensors")
    assert set(back) == set(ts)
    for k, v in ts.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_shards_and_index_and_stale_shards_go(tmp_path):
    ts = _tensors()
    files = write_shards(str(tmp_path), [_src(k, v) for k, v in ts.items()], max_shard_size=40)
    assert files[-1] == "model.safetensors.index.json" and len(files) > 3
    back = {}
    for f in files[:-1]:
        back.update(load_file(tmp_path / f))
    assert all(torch.equal(back[k], v) for k, v in ts.items())
    # A later save in one file: the old shards and index would mix in at load.
    write_shards(str(tmp_path), [_src("a", ts["a"])])
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]


def test_a_failing_read_leaves_the_folder_as_it_was(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"old")

    def broken():
        raise OSError(5, "Input/output error")

    srcs = [_src("a", torch.ones(4)), Source("b", (4,), torch.float32, broken)]
    with pytest.raises(OSError):
        write_shards(str(tmp_path), srcs, max_shard_size=16)
    assert os.listdir(tmp_path) == ["model.safetensors"]
    assert (tmp_path / "model.safetensors").read_bytes() == b"old"


def test_a_read_of_the_wrong_shape_is_refused(tmp_path):
    with pytest.raises(ValueError, match="expected"):
        write_shards(str(tmp_path), [Source("a", (4,), torch.float32, lambda: torch.ones(5))])
    assert os.listdir(tmp_path) == []


def test_a_planted_link_is_replaced_never_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(victim, out / "model.safetensors")
    write_shards(str(out), [_src("a", torch.ones(2))])
    assert victim.read_bytes() == b"precious"
    assert not os.path.islink(out / "model.safetensors")


def test_sizes_and_plans():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 * 2**20 and parse_size(7) == 7
    for bad in ("5 parsecs", "-1", 0):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(TypeError):
        parse_size(1.5)
    srcs = [_src(str(i), torch.zeros(n)) for i, n in enumerate([3, 3, 10, 1])]
    assert [[s.name for s in g] for g in plan_shards(srcs, 24)] == [["0", "1"], ["2"], ["3"]]
    with pytest.raises(ValueError, match="two tensors"):
        write_shards("/nonexistent", [srcs[0], srcs[0]])
