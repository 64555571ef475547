"""Build of the aio._C extension (C++17, pybind11, no libaio, no libtorch)."""

import os
from glob import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup
from setuptools.command.build_py import build_py

# Compile the translation units in parallel (NPY_NUM_BUILD_JOBS overrides).
ParallelCompile("NPY_NUM_BUILD_JOBS").install()

# The extension exports PyInit__C and nothing else. Toolchains that link
# libstdc++/libgcc statically (CUDA images do) would otherwise export their
# std:: symbols, which then interpose with the shared libstdc++ that torch
# loaded first and crash the first exception thrown. Hidden visibility covers
# our own code; the version script and --exclude-libs cover static archives.
VERSION_SCRIPT = "csrc/_C.map"
HERE = os.path.dirname(os.path.abspath(__file__))

# Warnings fail the build only on request (CI sets AIO_WERROR=1): a user's
# build with a newer compiler that warns about something new keeps working.
WARNINGS = ["-Wall", "-Wextra"] + (["-Werror"] if os.environ.get("AIO_WERROR") == "1" else [])
# AIO_OPT (default -O2): tests that only check how the extension links (its
# exports, its error translation) build it at -O0, three times faster.
OPT = os.environ.get("AIO_OPT", "-O2")
if OPT not in ("-O0", "-O1", "-O2", "-O3"):
    raise SystemExit(f"AIO_OPT must be one of -O0 -O1 -O2 -O3, got {OPT!r}")

ext = Pybind11Extension(
    "aio._C",
    sorted(glob("csrc/core/*.cpp")) + sorted(glob("csrc/bindings/*.cpp")),
    depends=sorted(glob("csrc/core/*.h")) + [VERSION_SCRIPT],
    cxx_std=17,
    # Pybind11Extension already passes -fvisibility=hidden.
    # -ffp-contract=off: the CPU Adam kernel (csrc/core/cpu_adam.cpp) must round
    # exactly like torch, so no multiply-add may be fused that the source does
    # not fuse itself; -fno-math-errno lets its sqrt loop vectorize.
    extra_compile_args=[
        OPT,
        *WARNINGS,
        "-fvisibility-inlines-hidden",
        "-ffp-contract=off",
        "-fno-math-errno",
    ],
    # Threads only; kernel AIO is reached through syscall(), so no -laio.
    extra_link_args=[
        "-pthread",
        f"-Wl,--version-script={os.path.join(HERE, VERSION_SCRIPT)}",
        "-Wl,--exclude-libs,ALL",
    ],
)

# AIO_DEEPSPEED=1 must reach processes that never import aio (HF Trainer,
# Accelerate, the deepspeed launcher), so a .pth file goes into site-packages
# next to the package: Python runs its line at startup (see _aio_startup.py).
PTH = "aio_deepspeed.pth"


class build_py_with_pth(build_py):
    """build_py that also ships PTH at the top of the install.

    A wheel gets it from build_lib. An editable install (PEP 660) does not
    install build_lib, only what its own strategy writes plus the files laid
    out in the editable wheel's folder, which is where setuptools points
    ``install_lib`` while it builds one; data_files would land under the
    prefix, not in site-packages.
    """

    def run(self) -> None:
        super().run()
        src = os.path.join(HERE, PTH)
        self.copy_file(src, os.path.join(self.build_lib, PTH), preserve_mode=False)
        if getattr(self, "editable_mode", False):
            wheel_dir = self.get_finalized_command("install").install_lib
            self.copy_file(src, os.path.join(wheel_dir, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


setup(ext_modules=[ext], cmdclass={"build_ext": build_ext, "build_py": build_py_with_pth})
