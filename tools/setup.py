"""setup.py: the two things pyproject.toml cannot say.

1. ``cachealloc_autoload.pth`` must land in site-packages itself (not in a package, not in
   data-files, which go to the prefix): build_py copies it to the root of the build directory,
   which becomes the wheel's purelib root.
2. The shared library is bundled into the package when one is found at build time:
   ``CACHEALLOC_LIBRARY`` (a file), else ``<repo>/build*/allocator/plugin/libcachealloc_plugin.so``
   (the newest). ``_build_info.py`` records the repository root, so an installed package still
   finds a library rebuilt later in that tree.

Build offline with the installed setuptools: ``pip install --no-build-isolation ./tools``.
"""

import glob
import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
LIB_NAME = "libcachealloc_plugin.so"
TORCH_LIB_NAME = "libcachealloc_torch.so"  # the full LibTorch adapter (cachealloc.enable(full=True))


def find_built_library(name=LIB_NAME, env_var="CACHEALLOC_LIBRARY", subdir="plugin"):
    env = os.environ.get(env_var)
    if env and Path(env).is_file():
        return Path(env)
    found = [Path(p) for p in glob.glob(str(REPO / "build*" / "allocator" / subdir / name))]
    found = [p for p in found if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


class BuildPy(build_py):
    def run(self):
        super().run()
        build_lib = Path(self.build_lib)
        shutil.copyfile(HERE / "cachealloc_autoload.pth", build_lib / "cachealloc_autoload.pth")
        pkg = build_lib / "cachealloc"
        pkg.mkdir(parents=True, exist_ok=True)
        for stale in pkg.glob("*.so"):  # pip builds in-tree: never ship a library from an older build
            stale.unlink()
        (pkg / "_build_info.py").write_text(
            '"""Written by setup.py at install time."""\n'
            f"REPO_ROOT = {str(REPO)!r}\n"
        )
        torch_lib = find_built_library(TORCH_LIB_NAME, "CACHEALLOC_TORCH_LIBRARY", "torch")
        if torch_lib is not None:
            shutil.copyfile(torch_lib, pkg / TORCH_LIB_NAME)
            print(f"cachealloc: bundled {torch_lib}")
        lib = find_built_library()
        if lib is not None:
            shutil.copyfile(lib, pkg / (lib.name if lib.name.startswith("libcachealloc") else LIB_NAME))
            print(f"cachealloc: bundled {lib}")
        else:
            print("cachealloc: no built libcachealloc_plugin.so found; the package will look in "
                  f"{REPO}/build*/allocator/plugin/ or CACHEALLOC_LIBRARY at run time")

    def get_outputs(self, include_bytecode=1):
        outputs = super().get_outputs(include_bytecode)
        return outputs + [os.path.join(self.build_lib, "cachealloc_autoload.pth")]


setup(cmdclass={"build_py": BuildPy})
