"""The command line that starts macspec in a child process, whatever the working directory.

`python -m macspec` puts the working directory first on sys.path, so a folder named `macspec`
there (a clone, with an editable install) would be imported instead of the installed package.
`-P` (Python 3.11+) leaves it out; older Pythons get the same from a one-line bootstrap.
"""

from __future__ import annotations

import sys

_BOOTSTRAP = "import sys, runpy; del sys.path[0]; runpy.run_module('macspec', run_name='__main__', alter_sys=True)"


def macspec_argv(*args: str) -> list[str]:
    """[python, ..., *args] running `macspec *args` from the installed package."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", "macspec", *args]
    return [sys.executable, "-c", _BOOTSTRAP, *args]
