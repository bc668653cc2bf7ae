"""The build behind `pip install .` and `python3 -m build` (pyproject.toml).

The extension mha._mha is built by the project's own CMake, in Release, for
the interpreter that runs this build, with libmha linked in statically (the
wheel then needs only the system libraries the README's packages bring:
OpenBLAS, OpenMP, libpng, zlib). MHA_BUILD_JOBS sets the parallel jobs
(default: every core). The version is the CMake project's.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def project_version():
    text = (ROOT / "CMakeLists.txt").read_text()
    match = re.search(r"project\(mha VERSION ([0-9]+\.[0-9]+\.[0-9]+)", text)
    if not match:
        raise RuntimeError("CMakeLists.txt: expected 'project(mha VERSION x.y.z'")
    return match.group(1)


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        build = Path(self.build_temp).resolve() / "cmake"
        jobs = os.environ.get("MHA_BUILD_JOBS", str(os.cpu_count() or 1))
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
            "-DBUILD_SHARED_LIBS=OFF", "-DCMAKE_POSITION_INDEPENDENT_CODE=ON",
            "-DMHA_BUILD_TESTS=OFF", "-DMHA_BUILD_TOOLS=OFF", "-DMHA_BUILD_BENCH=OFF",
            "-DMHA_BUILD_PYTHON=ON", f"-DPython3_EXECUTABLE={sys.executable}",
        ]
        subprocess.run(configure, check=True)
        subprocess.run(["cmake", "--build", str(build), "--target", "_mha", "-j", jobs], check=True)
        built = sorted((build / "python" / "mha").glob("_mha*.so"))
        if len(built) != 1:
            raise RuntimeError(f"expected one _mha extension in {build / 'python' / 'mha'}; found {built}")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built[0], target)


setup(
    version=project_version(),
    ext_modules=[Extension("mha._mha", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
)
