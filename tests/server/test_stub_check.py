"""The Python-backend stub check that `serve`, `doctor` and the test suite run first.

The broken stub is the real one with its libpython dependency renamed (same length,
so the ELF stays valid): the system loader then reports it missing, as on a Debian
machine without the libpython package.
"""

from __future__ import annotations

import sys

import pytest

from triton_disagg.errors import UserError
from triton_disagg.triton.stub_check import (check_stub, libpython_fix, libpython_package,
                                             missing_libraries)
from triton_disagg.triton.tritonserver import locate, server_env

VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


def test_the_real_stub_loads():
    install = locate()
    check_stub(install.stub_binary, server_env(install))


def test_missing_libpython_is_one_line_naming_it_and_the_fix(tmp_path):
    install = locate()
    real = f"libpython{VERSION}.so.1.0".encode()
    absent = f"libpython{VERSION}.so.9.9".encode()
    data = install.stub.read_bytes()
    assert real in data
    broken = tmp_path / "triton_python_backend_stub"
    broken.write_bytes(data.replace(real, absent))
    broken.chmod(0o755)
    env = server_env(install)
    assert missing_libraries(broken, env) == [absent.decode()]
    with pytest.raises(UserError) as info:
        check_stub(broken, env)
    message = str(info.value)
    assert "\n" not in message
    assert absent.decode() in message and "fix: " in message
    assert message.endswith(libpython_fix())


def test_the_fix_for_debians_python_is_its_libpython_package():
    assert libpython_package("/usr") == f"libpython{VERSION}"   # this machine is Debian
    assert f"apt-get install -y libpython{VERSION}" in libpython_fix("/usr")


def test_the_fix_for_a_pyenv_python_is_a_shared_build():
    assert libpython_package("/root/.pyenv/versions/3.11.7") is None
    assert "--enable-shared" in libpython_fix("/root/.pyenv/versions/3.11.7")
