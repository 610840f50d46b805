"""npattn's thread pool as a threadpoolctl library, so that
``threadpoolctl.threadpool_limits(1)`` limits npattn too and
``threadpool_info()`` lists it (user_api "npattn").

threadpoolctl is optional and takes tens of milliseconds to import, so npattn
does not import it: the controller is registered when threadpoolctl is
imported, or at once if it already was.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any


def _controller_class(threadpoolctl: Any) -> type:
    from . import __version__

    class NpattnController(threadpoolctl.LibController):
        """npattn's pool: its default thread count, read and capped through the C core."""

        user_api = "npattn"
        internal_api = "npattn"
        filename_prefixes = ("_core",)
        check_symbols = ("npattn_get_num_threads", "npattn_set_num_threads")

        def get_num_threads(self) -> int:
            return self.dynlib.npattn_get_num_threads()

        def set_num_threads(self, num_threads: int) -> None:
            self.dynlib.npattn_set_num_threads(int(num_threads))

        def get_version(self) -> str:
            return __version__

    return NpattnController


def _register(threadpoolctl: Any) -> None:
    if hasattr(threadpoolctl, "register"):  # threadpoolctl >= 3.3
        threadpoolctl.register(_controller_class(threadpoolctl))


class _RegisterAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds threadpoolctl as the other finders would, and registers npattn once it has run."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "threadpoolctl":
            return None
        sys.meta_path.remove(self)  # one registration; find the real module
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            self._inner, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        _register(module)


def install() -> None:
    if "threadpoolctl" in sys.modules:
        _register(sys.modules["threadpoolctl"])
    else:
        sys.meta_path.insert(0, _RegisterAfterImport())
