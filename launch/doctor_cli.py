"""``triton-disagg doctor [--install]``: can this host serve? Fixes what it can.

Checks that a tritonserver is found and that its Python-backend stub can start with
this Python (see :mod:`.stub_check`). With ``--install``, as root on Debian or
Ubuntu, a missing ``libpython`` package is installed with apt-get; anywhere else the
one-line fix is printed and the exit code is 2. ``make demo`` and ``make test`` run
it first, so a fresh machine fails in a second with the fix, not after minutes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from triton_disagg.errors import UserError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor", help="check that tritonserver and its Python stub can run here",
        description="Check that a tritonserver is found and that its Python-backend stub "
                    "can load this Python's shared libpython. --install fixes a missing "
                    "libpython package with apt-get (root, Debian/Ubuntu).")
    p.add_argument("--install", action="store_true",
                   help="install what is missing where possible (apt-get, as root)")
    p.add_argument("--tritonserver", help="tritonserver binary (default: the one in nvidia-pytriton)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from triton_disagg.triton.stub_check import check_stub, libpython_package
    from triton_disagg.triton.tritonserver import locate, server_env

    install = locate(args.tritonserver)
    env = server_env(install)
    try:
        check_stub(install.stub_binary, env)
    except UserError:
        package = libpython_package()
        if not (args.install and package and os.geteuid() == 0):
            raise
        print(f"triton-disagg doctor: the Python backend stub needs {package}; installing it "
              f"with apt-get ...", flush=True)
        apt_env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=apt_env)
        subprocess.run(["apt-get", "install", "-y", "-qq", package], check=True, env=apt_env)
        check_stub(install.stub_binary, env)
    print(f"triton-disagg doctor: ok (tritonserver {install.binary}; the Python "
          f"{sys.version_info.major}.{sys.version_info.minor} backend stub loads)", flush=True)
    return 0
