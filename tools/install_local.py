#!/usr/bin/env python3
"""install_local.py: install the cachealloc Python package without pip (offline machines).

``pip install --no-build-isolation ./tools`` needs setuptools and wheel. Where they are missing
and cannot be fetched, this script does the same by copying: the package, the startup hook
``cachealloc_autoload.pth`` and the newest built ``libcachealloc_plugin.so`` (or
CACHEALLOC_LIBRARY) into this interpreter's site-packages (or --target).

    python3 tools/install_local.py             # install
    python3 tools/install_local.py --uninstall
"""

import argparse
import glob
import os
import shutil
import site
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
LIB = "libcachealloc_plugin.so"


def newest_library():
    env = os.environ.get("CACHEALLOC_LIBRARY")
    if env and Path(env).is_file():
        return Path(env)
    found = [Path(p) for p in glob.glob(str(REPO / "build*" / "allocator" / "plugin" / LIB))]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=sysconfig.get_paths()["purelib"], help="site-packages directory")
    p.add_argument("--user", action="store_true", help="install into the user site-packages")
    p.add_argument("--uninstall", action="store_true")
    args = p.parse_args()
    target = Path(site.getusersitepackages() if args.user else args.target)
    pkg, pth = target / "cachealloc", target / "cachealloc_autoload.pth"
    if args.uninstall:
        shutil.rmtree(pkg, ignore_errors=True)
        pth.unlink(missing_ok=True)
        print(f"removed {pkg} and {pth}")
        return 0
    target.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(pkg, ignore_errors=True)
    shutil.copytree(HERE / "cachealloc", pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (pkg / "_build_info.py").write_text(f'"""Written by install_local.py."""\nREPO_ROOT = {str(REPO)!r}\n')
    shutil.copyfile(HERE / "cachealloc_autoload.pth", pth)
    lib = newest_library()
    if lib is not None:
        shutil.copyfile(lib, pkg / LIB)
    print(f"installed cachealloc into {target}" + (f" with {lib}" if lib else " (no built library found: "
          f"it will be looked up in {REPO}/build*/allocator/plugin/ or CACHEALLOC_LIBRARY)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
