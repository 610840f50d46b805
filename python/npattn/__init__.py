"""npattn: scaled dot-product attention with grouped-query attention on NumPy arrays.

    out = softmax(scale * q @ k^T + mask) @ v      (per query head, per row)

``sdpa`` runs a C core on OpenBLAS; ``reference`` is the same computation in
plain NumPy, written to be read. ``python -m npattn`` checks one against the
other and times them.

Threads: ``threadpoolctl.threadpool_limits(n)`` caps npattn's pool as it caps
BLAS (``user_api="npattn"`` for npattn alone), ``NPATTN_NUM_THREADS`` sets the
default, and ``sdpa(..., threads=n)`` one call's.
"""

__version__ = "0.4.0.dev0"

import atexit as _atexit

from . import _loader

_core = _loader.load_core()  # before anything else loads the extension

from . import reference, testing  # noqa: E402
from ._api import Grads, Lse, attention_weights, causal_mask, merge, paged_attention, sdpa, sdpa_backward  # noqa: E402
from ._quant import Quantized, dequantize, quantize  # noqa: E402

# Before the interpreter stops its threads, stop every call in flight (a daemon
# thread's call then ends it with SystemExit), so that none is left computing
# while the process tears its libraries down.
_atexit.register(_core.shutdown)

from . import _threadpool  # noqa: E402

_threadpool.install()  # threadpoolctl controls npattn's threads too

__all__ = [
    "sdpa",
    "paged_attention",
    "sdpa_backward",
    "Grads",
    "Lse",
    "attention_weights",
    "merge",
    "causal_mask",
    "quantize",
    "dequantize",
    "Quantized",
    "reference",
    "testing",
    "__version__",
]
