"""Optional fused Triton kernels: a kernel module imported once where Triton is installed; a kernel that
fails on this machine warns once, and its caller takes the torch path from then on."""
from __future__ import annotations

import functools
import importlib
import warnings
from types import ModuleType


class OptionalKernel:
    def __init__(self, module: str, label: str) -> None:
        self.module_name, self.label = module, label
        self.failures: list[str] = []

    @functools.cached_property
    def module(self) -> ModuleType | None:
        """The kernel module, or None where Triton is missing or cannot initialise here."""
        try:
            return importlib.import_module(self.module_name)
        except (ImportError, RuntimeError):
            return None

    @property
    def usable(self) -> bool:
        return not self.failures and self.module is not None

    def run(self, function: str, *args):
        """module.function(*args), or None: no kernel, or one that failed here (now or before)."""
        if not self.usable:
            return None
        try:
            return getattr(self.module, function)(*args)
        except Exception as err:     # a Triton build that cannot compile for this GPU must not stop generation
            self.failures.append(str(err))
            warnings.warn(f"{self.label}: the fused Triton kernel failed ({type(err).__name__}: {str(err)[:200]}); "
                          "decoding with torch instead", RuntimeWarning, stacklevel=3)
            return None
