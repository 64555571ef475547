"""Build of the aio._C extension (C++17, pybind11, no libaio, no libtorch)."""

from glob import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

# Compile the translation units in parallel (NPY_NUM_BUILD_JOBS overrides).
ParallelCompile("NPY_NUM_BUILD_JOBS").install()

ext = Pybind11Extension(
    "aio._C",
    sorted(glob("csrc/core/*.cpp")) + sorted(glob("csrc/bindings/*.cpp")),
    cxx_std=17,
    extra_compile_args=["-O2", "-Wall", "-Wextra"],
    # Threads only; kernel AIO is reached through syscall(), so no -laio.
    extra_link_args=["-pthread"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
