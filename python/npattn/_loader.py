"""Loading the C extension with the OpenBLAS kernels npattn trusts.

On an ARM CPU with SME (Apple M4, recent Arm cores), OpenBLAS 0.3.34 picks
its SME kernels, whose matrix products npattn's checks found wrong (at a
streaming vector length other than 512 bits, and when called from two
threads at once; README, "Platforms"). Unless OPENBLAS_CORETYPE is set, the
library is therefore loaded with OPENBLAS_CORETYPE=NEOVERSEN1 (its NEON
kernels), and the variable removed again at once, so that nothing else in
the process sees it. The C core checks the BLAS once more on first use
(npattn_blas_ok) and refuses to run on wrong products.
"""

from __future__ import annotations

import os
import platform
import sys
from types import ModuleType

PINNED_CORE = "NEOVERSEN1"


def has_sme() -> bool:
    """Whether this is an ARM CPU with the Scalable Matrix Extension."""
    if platform.machine().lower() not in ("arm64", "aarch64"):
        return False
    if sys.platform == "darwin":
        import ctypes

        value, size = ctypes.c_int(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_int))
        libc = ctypes.CDLL(None)
        found = libc.sysctlbyname(b"hw.optional.arm.FEAT_SME", ctypes.byref(value), ctypes.byref(size), None, 0)
        return found == 0 and value.value != 0
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("Features") and "sme" in line.split(":", 1)[1].split() for line in f)
    except OSError:
        return False


def load_core() -> ModuleType:
    """npattn._core, its OpenBLAS held to NEON kernels on a CPU with SME (see above)."""
    pin = "OPENBLAS_CORETYPE" not in os.environ and has_sme()
    if pin:
        os.environ["OPENBLAS_CORETYPE"] = PINNED_CORE
    try:
        from . import _core
    finally:
        if pin:
            del os.environ["OPENBLAS_CORETYPE"]
    return _core
