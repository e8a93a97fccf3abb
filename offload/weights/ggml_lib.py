"""ggml's CPU library through ctypes: the entry points a one-product graph needs, loaded once per process.

The libggml is llama-cpp-python's (located, not imported: that would load libllama) or the folder
SPECSTREAM_GGML_LIB names; nothing is built here. ggml_linear.py builds its weights and products on it.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from pathlib import Path

import torch
from torch import Tensor

ALIGN = 32                # ggml's TENSOR_ALIGNMENT: a buffer over our memory must start on it
F32 = 0
LIBRARY_ENV = "SPECSTREAM_GGML_LIB"
_VOID = ctypes.c_void_p


class GgmlMissingError(RuntimeError):
    """--cpu-kernel ggml without a libggml to call."""


_LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, _VOID)


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", _VOID), ("no_alloc", ctypes.c_bool)]


def library_dir() -> Path | None:
    """The folder holding libggml-base.so and libggml-cpu.so: $SPECSTREAM_GGML_LIB, else llama-cpp-python's."""
    if os.environ.get(LIBRARY_ENV):
        return Path(os.environ[LIBRARY_ENV])
    spec = importlib.util.find_spec("llama_cpp")          # located, not imported (that would load libllama)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


class Ggml:
    """The entry points a one-product graph needs, and one CPU backend for the process."""

    def __init__(self, folder: Path) -> None:
        base = ctypes.CDLL(str(folder / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        cpu = ctypes.CDLL(str(folder / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        fn = _function
        self.init = fn(base, "ggml_init", _VOID, _InitParams)
        self.free = fn(base, "ggml_free", None, _VOID)
        self.new_2d = fn(base, "ggml_new_tensor_2d", _VOID, _VOID, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
        self.mul_mat = fn(base, "ggml_mul_mat", _VOID, _VOID, _VOID, _VOID)
        self.new_graph = fn(base, "ggml_new_graph_custom", _VOID, _VOID, ctypes.c_size_t, ctypes.c_bool)
        self.expand = fn(base, "ggml_build_forward_expand", None, _VOID, _VOID)
        self.nbytes = fn(base, "ggml_nbytes", ctypes.c_size_t, _VOID)
        self.buffer_free = fn(base, "ggml_backend_buffer_free", None, _VOID)
        self.tensor_alloc = fn(base, "ggml_backend_tensor_alloc", ctypes.c_int, _VOID, _VOID, _VOID)
        self.compute = fn(base, "ggml_backend_graph_compute", ctypes.c_int, _VOID, _VOID)
        self.from_ptr = fn(cpu, "ggml_backend_cpu_buffer_from_ptr", _VOID, _VOID, ctypes.c_size_t)
        self.set_threads = fn(cpu, "ggml_backend_cpu_set_n_threads", None, _VOID, ctypes.c_int)
        self.alloc_in = fn(base, "ggml_backend_alloc_ctx_tensors_from_buft", _VOID, _VOID, _VOID)
        self.tensor_set = fn(base, "ggml_backend_tensor_set", None, _VOID, _VOID, ctypes.c_size_t, ctypes.c_size_t)
        self.buffer_alloc = fn(base, "ggml_backend_buft_alloc_buffer", _VOID, _VOID, ctypes.c_size_t)
        self.buffer_base = fn(base, "ggml_backend_buffer_get_base", ctypes.c_size_t, _VOID)
        self.data = fn(base, "ggml_get_data", ctypes.c_size_t, _VOID)
        self._quiet = _LOG_CALLBACK(lambda level, text, user: None)    # kept: ggml calls it
        fn(base, "ggml_log_set", None, _LOG_CALLBACK, _VOID)(self._quiet, None)   # no "repack: ..." lines on stderr
        self.repack_type = self._repack_buffer_type(base, cpu)
        self.cpu_type = fn(cpu, "ggml_backend_cpu_buffer_type", _VOID)()       # ggml's plain CPU buffers
        # metadata of 3 tensors (x, y, and room) and a graph of 4 nodes, per product
        tensor = fn(base, "ggml_tensor_overhead", ctypes.c_size_t)()
        graph = fn(base, "ggml_graph_overhead_custom", ctypes.c_size_t, ctypes.c_size_t, ctypes.c_bool)(4, False)
        self.product_context_bytes = 3 * tensor + graph
        self.weight_context_bytes = tensor
        fn(cpu, "ggml_cpu_init", None)()
        self.backend = fn(cpu, "ggml_backend_cpu_init", _VOID)()
        self.threads = 0
        self.lock = threading.Lock()      # one backend: one graph at a time

    def context(self, size: int) -> int:
        return self.init(_InitParams(size, None, True))

    @staticmethod
    def _repack_buffer_type(base, cpu) -> int | None:
        """The CPU device's extra buffer type that repacks Q4_0 and Q4_K into interleaved tiles (llama.cpp's
        choice at load), through the registry's public entry point; None where the build has none."""
        registry = _function(cpu, "ggml_backend_cpu_reg", _VOID)()
        device = _function(base, "ggml_backend_reg_dev_get", _VOID, _VOID, ctypes.c_size_t)(registry, 0)
        lookup = _function(base, "ggml_backend_reg_get_proc_address", _VOID, _VOID, ctypes.c_char_p)
        address = lookup(registry, b"ggml_backend_dev_get_extra_bufts")
        if not address:
            return None
        extra = ctypes.CFUNCTYPE(ctypes.POINTER(_VOID), _VOID)(address)(device)      # NULL-terminated list
        return extra[0] if extra and extra[0] else None

    def place(self, tensor: int, pointer: int, size: int) -> int:
        """Puts a ggml tensor's data at our memory [pointer, pointer + size): a buffer over it (to free)."""
        if pointer % ALIGN:
            raise ValueError(f"ggml needs {ALIGN}-byte aligned data, got an address {pointer % ALIGN} past it")
        buffer = self.from_ptr(pointer, size)
        if not buffer or self.tensor_alloc(buffer, tensor, pointer) != 0:
            raise RuntimeError("ggml could not place a tensor in memory given to it")
        return buffer

    def compute_graph(self, graph: int) -> None:
        with self.lock:
            if self.threads != torch.get_num_threads():
                self.threads = torch.get_num_threads()
                self.set_threads(self.backend, self.threads)
            if self.compute(self.backend, graph) != 0:
                raise RuntimeError("ggml's CPU backend failed a matrix product")


class Product:
    """y [M, N] = x [M, K] @ W^T as a one-node ggml graph over torch buffers x and y (fp32, made here): built
    once per row count M, run as often as asked."""

    def __init__(self, lib: Ggml, weight: int, rows: int, width: int, num_out: int) -> None:
        self.lib, self.buffers = lib, []
        self.x, self.y = torch.empty(rows, width), torch.empty(rows, num_out)
        self.context = lib.context(lib.product_context_bytes)
        x_tensor = lib.new_2d(self.context, F32, width, rows)                     # ggml: ne0 = K, ne1 = M
        y_tensor = lib.mul_mat(self.context, weight, x_tensor)                    # ne0 = N, ne1 = M
        self.graph = lib.new_graph(self.context, 4, False)
        lib.expand(self.graph, y_tensor)
        self.buffers.append(lib.place(x_tensor, self.x.data_ptr(), self.x.numel() * 4))
        self.buffers.append(lib.place(y_tensor, self.y.data_ptr(), self.y.numel() * 4))

    def run(self, x: Tensor) -> Tensor:
        """x [M, K] -> y [M, N], this product's own buffer (overwritten by the next run)."""
        self.x.copy_(x)
        self.lib.compute_graph(self.graph)
        return self.y

    def __del__(self) -> None:
        for buffer in self.buffers:
            self.lib.buffer_free(buffer)
        if getattr(self, "context", 0):
            self.lib.free(self.context)


def _function(lib, name: str, restype, *argtypes):
    function = getattr(lib, name)
    function.restype, function.argtypes = restype, list(argtypes)
    return function


_LOADED: list[Ggml] = []


def ggml() -> Ggml:
    """The process's libggml (loaded once); GgmlMissingError naming what to install where there is none."""
    if not _LOADED:
        folder = library_dir()
        if folder is None or not (folder / "libggml-cpu.so").exists():
            where = f"{LIBRARY_ENV}={folder}" if os.environ.get(LIBRARY_ENV) else "no llama_cpp package"
            raise GgmlMissingError(f"--cpu-kernel ggml needs ggml's CPU library ({where}): pip install "
                                   f"llama-cpp-python, or set {LIBRARY_ENV} to a folder with libggml-cpu.so")
        try:
            _LOADED.append(Ggml(folder))
        except (OSError, AttributeError) as err:
            raise GgmlMissingError(f"--cpu-kernel ggml: {folder} has no usable libggml ({err})") from None
    return _LOADED[0]


def loaded() -> Ggml | None:
    """The libggml if this process has loaded it (never loads it: for finalizers)."""
    return _LOADED[0] if _LOADED else None


def available() -> bool:
    try:
        ggml()
        return True
    except GgmlMissingError:
        return False
