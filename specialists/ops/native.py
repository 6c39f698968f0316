"""Cantata's own CPU kernels (native/cantata_cpu.c), compiled here on first use and called through ctypes.

What they are for: weight-only int8 decoding on the CPU (the engine's `quantization="int8"`). At
SmolLM2-135M a decode step through torch ops was ~10 ms: ~5 ms of int8 products that reached a third
of the machine's read bandwidth, and ~5 ms of ~60 small ops per layer and the Python between them.
`cantata_llama_forward` runs the whole stack of a Llama for a step's rows in one call,
`cantata_qlinear` one product (the lm_head; `cantata_blinear` over GGML blocks), `cantata_mtp_rebuild` / `cantata_mtp_chain` the MTP
drafter's rebuild and greedy chain (specialists/drafter_native.py).

Built with the system C compiler (`CC`, else `cc`) for AVX-512 F/BW/VL/VNNI, into
~/.cache/cantata/native (`CANTATA_CACHE` moves it), keyed by the source's sha256; loaded after torch,
so its OpenMP calls share torch's libgomp (one thread pool). Not used, and `available()` says why, where
the CPU lacks those instructions, no compiler runs, or CANTATA_NATIVE=0: the torch path serves then.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

__all__ = ["available", "why_unavailable", "library", "qlinear", "blinear", "Addresses", "int64", "MAX_K"]

SOURCE = Path(__file__).with_name("native") / "cantata_cpu.c"
# -ffp-contract=off: the compiler never fuses a scalar a * b + c into one rounding on its own (FMAs only
# where the source asks, through intrinsics), so two code paths over the same row round alike
FLAGS = ["-O3", "-ffp-contract=off", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-fopenmp",
         "-fPIC", "-shared"]
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma")
MAX_K = 32768  # the widest product input the int32 lanes take without overflow (see lanes_total)

_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_ok() -> str | None:
    try:
        flags = next((ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("flags")), [])
    except OSError:
        return "no /proc/cpuinfo"
    missing = [f for f in CPU_FLAGS if f not in flags]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def _cache_dir() -> Path:
    return Path(os.environ.get("CANTATA_CACHE", Path.home() / ".cache" / "cantata")) / "native"


def _build() -> Path:
    src = SOURCE.read_bytes()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (set CC or install gcc)")
    tag = hashlib.sha256(src + " ".join(FLAGS).encode()).hexdigest()[:16]
    out = _cache_dir() / f"cantata_cpu-{tag}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".so", delete=False) as tmp:
        pass
    try:
        proc = subprocess.run([cc, *FLAGS, "-o", tmp.name, str(SOURCE), "-lm"], capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{cc} failed on {SOURCE.name}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp.name, out)  # atomic: processes building at once each get a whole file
    finally:
        if os.path.exists(tmp.name):
            os.unlink(tmp.name)
    for old in out.parent.glob("cantata_cpu-*.so"):  # builds of earlier sources (a loaded one stays mapped)
        if old != out:
            old.unlink(missing_ok=True)
    return out


DEPTH_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)  # cantata_mtp_chain's per-draft call under a grammar


def _load() -> None:
    if os.environ.get("CANTATA_NATIVE", "1") == "0":
        _state["why"] = "CANTATA_NATIVE=0"
        return
    why = _cpu_ok()
    if why:
        _state["why"] = why
        return
    try:
        lib = ctypes.CDLL(str(_build()))
    except (RuntimeError, OSError) as e:
        _state["why"] = str(e)
        return
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.cantata_qlinear.argtypes = [p, i, i, p, p, p, i, p, p, p, p, i]
    lib.cantata_blinear.argtypes = [p, i, i, i, p, p, i, p, p, p, p, i]
    lib.cantata_llama_forward.argtypes = [p] * 12
    lib.cantata_mtp_rebuild.argtypes = [p] * 11
    lib.cantata_mtp_chain.argtypes = [p] * 6 + [i, i, p, p, p, i, p, DEPTH_FN]
    for fn in (lib.cantata_qlinear, lib.cantata_blinear, lib.cantata_llama_forward, lib.cantata_mtp_rebuild, lib.cantata_mtp_chain):
        fn.restype = i
    _state["lib"] = lib


def library():
    """The loaded library, or None (see why_unavailable)."""
    if "done" not in _state:
        with _lock:
            if "done" not in _state:
                _load()
                _state["done"] = True
    return _state.get("lib")


def available() -> bool:
    return library() is not None


def why_unavailable() -> str | None:
    library()
    return _state.get("why")


class Addresses:
    """The addresses a native call's pointer table holds, and the tensors behind them (kept alive here)."""

    def __init__(self) -> None:
        self.keep: list[torch.Tensor] = []

    def __call__(self, t: torch.Tensor | None) -> int:
        """t's (contiguous) data address, 0 for None."""
        if t is None:
            return 0
        t = t.contiguous()
        self.keep.append(t)
        return t.data_ptr()


def int64(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous int64 tensor, as the kernels read indices (a no-op for the runner's int64 views)."""
    return t.to(torch.int64).contiguous()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def qlinear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 @ (w [N, K] int8 * scale [N] fp32)^T (+ bias) -> [M, N] fp32, x quantized per row to
    int16 (cantata_qlinear). Each row's result is independent of the others, bit for bit."""
    x = x.contiguous()
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty(M, N, dtype=torch.float32)
    if M:
        xq = torch.empty(M, K, dtype=torch.int16)
        xs = torch.empty(M, dtype=torch.float32)
        library().cantata_qlinear(x.data_ptr(), M, K, w.data_ptr(), scale.data_ptr(), _ptr(bias), N, out.data_ptr(),
                                  None, xq.data_ptr(), xs.data_ptr(), torch.get_num_threads())
    return out


def blinear(x: torch.Tensor, kind: int, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 @ a weight of GGML blocks (specialists/ggml_blocks.pack; kind: its kernel type)
    -> [M, n] fp32, x rounded to int8 per block of 32 (cantata_blinear); rows independent, bit for bit."""
    x = x.contiguous()
    M, K = x.shape
    out = torch.empty(M, n, dtype=torch.float32)
    if M:
        xq = torch.empty(M, K, dtype=torch.int8)
        sa, sb = torch.empty(2, M, K // 32, dtype=torch.float32)
        rc = library().cantata_blinear(x.data_ptr(), M, K, kind, packed.data_ptr(), _ptr(bias), n, out.data_ptr(),
                                       xq.data_ptr(), sa.data_ptr(), sb.data_ptr(), torch.get_num_threads())
        if rc:
            raise ValueError(f"cantata_blinear: K {K} is not a multiple of 32 or block type {kind} is unknown")
    return out
