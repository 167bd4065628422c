"""Swap two names in a loop, as an attacker's agent does to race rcoder's git (issue 51):
``renameat2(RENAME_EXCHANGE)`` (coreutils here has no ``mv --exchange``), standard library only.

    swap_names.py A B GO SECONDS

While the file ``GO`` exists, ``A`` and ``B`` swap as fast as they can (a swap that fails, a name
rcoder moved meanwhile, is let be); while it does not, they are left as they were at the start
(swapped back if need be). Ends after ``SECONDS`` (a bound: whatever happens to the test, the loop
stops), as they were at the start.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def main(a: str, b: str, go: str, seconds: float) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    first, second = a.encode(), b.encode()
    link_first = os.path.islink(a)  # how they were at the start

    def swap() -> None:
        libc.renameat2(_AT_FDCWD, first, _AT_FDCWD, second, _RENAME_EXCHANGE)  # a failure: a name rcoder moved

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if os.path.exists(go):
            for _ in range(100):
                swap()
        elif os.path.islink(a) != link_first and os.path.lexists(b):
            swap()
        else:
            time.sleep(0.001)  # idle until told to swap
    if os.path.islink(a) != link_first:
        swap()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]))
