"""Just-in-time build of the C++ CPU Adam library, cached on disk.

The source (``csrc/cpu_adam.cpp``) is compiled with ``torch.utils.cpp_extension.load`` into a
plain shared library (no torch headers) and called through ctypes. On x86 the library is built
for the architecture's baseline and picks AVX-512, AVX2 or its portable loop at run time, so
one build serves every x86 CPU; elsewhere it is built with ``-march=native`` for this CPU.
The build directory is ``$COLOSSAL_KERNELS_CACHE`` (default ``~/.cache/colossal/kernels``)
``/cpu_adam-<key>``, where the key hashes the source, the flags, the compiler, the torch and
Python versions and the target (the architecture on x86, the CPU's instruction-set flags
elsewhere), so a cache shared between machines never hands out a library built for another
CPU. Nothing happens at import; the first optimizer step that needs it builds it (or loads
the cached build).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import sys
import threading
from functools import lru_cache
from pathlib import Path

import torch

from colossal.core import get_logger

logger = get_logger(__name__)

CACHE_ENV = "COLOSSAL_KERNELS_CACHE"
SOURCE = Path(__file__).with_name("csrc") / "cpu_adam.cpp"
ABI_VERSION = 2
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
# x86: runtime dispatch in the source, so no -march (the build runs on any x86 CPU).
CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-std=c++17", *(() if X86 else ("-march=native",)))
LDFLAGS = ("-fopenmp",)
_DONE_MARKER = ".complete"
_lock = threading.Lock()


def cache_root() -> Path:
    """Directory holding cached builds (``$COLOSSAL_KERNELS_CACHE`` or the user cache)."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "colossal" / "kernels"


def compiler() -> str:
    """The C++ compiler torch's extension builder uses (``$CXX``, default ``c++``)."""
    return os.environ.get("CXX") or "c++"


def compiler_path() -> str | None:
    """Absolute path of :func:`compiler`, or ``None`` when it cannot be found."""
    return shutil.which(compiler())


@lru_cache(maxsize=1)
def _cpu_signature() -> str:
    if X86:  # one build serves every x86 CPU (the instruction set is chosen at run time)
        return platform.machine()
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    flags = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} {flags}"


def build_key() -> str:
    """Hash identifying one build (source, flags, compiler, torch, Python, target).

    The instruction set a step runs (``COLOSSAL_CPU_ADAM_ISA``) is chosen at run time and is
    not part of the key: one build serves them all.
    """
    h = hashlib.sha256()
    h.update(SOURCE.read_bytes())
    for part in (*CFLAGS, *LDFLAGS, compiler(), torch.__version__, sys.version, _cpu_signature()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def build_dir() -> Path:
    """Where this process's build lives."""
    return cache_root() / f"cpu_adam-{build_key()}"


def _library_name() -> str:
    return f"colossal_cpu_adam_{build_key()}"


def is_cached() -> bool:
    """Whether a finished build for this machine is in the cache."""
    directory = build_dir()
    return (directory / _DONE_MARKER).exists() and (directory / f"{_library_name()}.so").exists()


def load_library() -> ctypes.CDLL:
    """Build (once, cached on disk) and load the C++ library.

    Returns:
        The loaded library with its argument types declared.

    Raises:
        RuntimeError: No compiler, a failed build, or a library with the wrong ABI.
    """
    with _lock:
        return _load_locked()


@lru_cache(maxsize=1)
def _load_locked() -> ctypes.CDLL:
    directory = build_dir()
    name = _library_name()
    path = directory / f"{name}.so"
    if not is_cached():
        if compiler_path() is None:
            raise RuntimeError(
                f"C++ compiler {compiler()!r} not found (set CXX to a working compiler)"
            )
        directory.mkdir(parents=True, exist_ok=True)
        logger.info("building the C++ CPU Adam kernel in %s (once per machine)", directory)
        from torch.utils.cpp_extension import load

        load(
            name=name, sources=[str(SOURCE)], extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS), build_directory=str(directory),
            is_python_module=False, verbose=False,
        )
        (directory / _DONE_MARKER).write_text(f"{name}\n", encoding="ascii")
    lib = ctypes.CDLL(str(path))
    if lib.colossal_adam_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{path} has ABI {lib.colossal_adam_abi_version()}, need {ABI_VERSION}")
    p, f, i64, i32 = ctypes.c_void_p, ctypes.c_float, ctypes.c_int64, ctypes.c_int
    lib.colossal_adam_step.restype = i32
    lib.colossal_adam_step.argtypes = [
        i64, p, p, p, p, p, p, p, p, p, p, f, f, f, f, f, i32, f, i32, i32,
    ]
    for fn in (lib.colossal_adam_supported_isas, lib.colossal_adam_last_threads):
        fn.restype, fn.argtypes = i32, []
    lib.colossal_adam_resolve_isa.restype = i32
    lib.colossal_adam_resolve_isa.argtypes = [i32]
    return lib


def describe_build() -> str:
    """One line for the registry report: compiler and cache state."""
    cc = compiler_path()
    if is_cached():
        return f"cached build in {build_dir()}"
    if cc is None:
        return f"C++ compiler {compiler()!r} not found (set CXX)"
    return f"compiler {cc}; builds at first use into {build_dir()}"
