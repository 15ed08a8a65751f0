"""A CPU matrix-vector kernel for float32 activations and weights whose values are bfloat16 numbers.

A decode step of a few sequences streams every weight once from memory, so its matmuls take as long as the
bytes take to arrive. Checkpoints shipped in bf16 and run in float32 hold float32 weights that are exactly
bf16 values: stored as bf16 they are half the bytes, and widening them back to float32 (a 16-bit shift) inside
the dot product gives the same products, summed in float32. `gemv_bf16` computes y = x W^T that way for a
few rows of x; the worker's linear layers use it where `bf16_shadow` found such a weight (layers.py).

The kernel is C (GCC/Clang vector extensions, so it builds for AVX-512, AVX2 or NEON alike with
-march=native), compiled once per machine with the system C compiler into `$TESTBED_CACHE/kernels/` and
called through ctypes; its threads are OpenMP's, as many as torch's intra-op threads. Each output is one
thread's dot product in a fixed order, so results depend neither on the thread count nor on the other rows
of x. Where no compiler
works, or TESTBED_CPU_GEMV=0, `available()` is False and the layers keep torch's matmul.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MAX_ROWS = 8  # rows of x up to which the layers use the kernel (at 8 rows over twice as fast as torch's float32 matmul)

SOURCE = r"""
#include <stdint.h>
#include <string.h>

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

static inline f32x16 widen(const uint16_t *p) {  /* 16 bf16 -> float32: the bits shifted up by 16 */
    u16x16 h; memcpy(&h, p, sizeof h);
    u32x16 w = __builtin_convertvector(h, u32x16) << 16;
    f32x16 f; memcpy(&f, &w, sizeof f);
    return f;
}

static inline f32x16 load(const float *p) { f32x16 f; memcpy(&f, p, sizeof f); return f; }

static inline float bf16(uint16_t h) { uint32_t w = (uint32_t)h << 16; float f; memcpy(&f, &w, 4); return f; }

static inline float total(f32x16 a) {  /* a fixed pairwise order */
    float s[16]; memcpy(s, &a, sizeof s);
    for (int half = 8; half > 0; half /= 2)
        for (int i = 0; i < half; i++) s[i] += s[i + half];
    return s[0];
}

/* Rows 0 .. MB - 1 of x (ldx apart) against one row wn of w, into y[0], y[ldy], ...: each bf16 value is widened
   once for the MB rows. Every output is summed in the same order whatever MB is. */
static inline __attribute__((always_inline)) void rows(const float *x, int64_t ldx, const uint16_t *wn, float *y,
                                                       int64_t ldy, int64_t K, const int MB) {
    f32x16 a0[4] = {{0}}, a1[4] = {{0}};
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __builtin_prefetch(wn + k + 1024, 0, 3);
        f32x16 w0 = widen(wn + k), w1 = widen(wn + k + 16);
        for (int j = 0; j < MB; j++) {
            a0[j] += load(x + j * ldx + k) * w0;
            a1[j] += load(x + j * ldx + k + 16) * w1;
        }
    }
    if (k + 16 <= K) {
        f32x16 w0 = widen(wn + k);
        for (int j = 0; j < MB; j++) a0[j] += load(x + j * ldx + k) * w0;
        k += 16;
    }
    for (int j = 0; j < MB; j++) {
        float tail = 0.0f;
        for (int64_t t = k; t < K; t++) tail += x[j * ldx + t] * bf16(wn[t]);
        y[j * ldy] = total(a0[j] + a1[j]) + tail;
    }
}

/* y[m, n] = sum_k x[m, k] * w[n, k] for m < M, n < N; x, y float32 row-major (rows ldx, ldy apart),
   w bf16 bits row-major [N, K]. Threads split the rows of w; a row is read from memory once for all M,
   widened once per 4 rows of x. */
void gemv_bf16(const float *x, int64_t ldx, const uint16_t *w, float *y, int64_t ldy,
               int64_t M, int64_t N, int64_t K, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *wn = w + n * K;
        for (int64_t m = 0; m < M; m += 4) {
            const float *xm = x + m * ldx;
            float *ym = y + m * ldy + n;
            switch (M - m) {
                case 1: rows(xm, ldx, wn, ym, ldy, K, 1); break;
                case 2: rows(xm, ldx, wn, ym, ldy, K, 2); break;
                case 3: rows(xm, ldx, wn, ym, ldy, K, 3); break;
                default: rows(xm, ldx, wn, ym, ldy, K, 4);
            }
        }
    }
}
"""

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    root = os.environ.get("TESTBED_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "testbed") / "kernels"


def _machine_key() -> str:
    """What -march=native depends on: the processor's model and flags (the machine type where /proc lacks them)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))][:2]
        return "".join(lines) or platform.machine()
    except OSError:
        return platform.machine()


def _build(compiler: str, path: Path) -> None:
    """Compile SOURCE into `path`, written under a temporary name and renamed, so a concurrent first use never
    loads half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, out = Path(tmp) / "gemv.c", Path(tmp) / path.name
        src.write_text(SOURCE)
        subprocess.run([compiler, *_FLAGS, str(src), "-o", str(out)], check=True, capture_output=True, timeout=120)
        os.replace(out, path)


def _load() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        logger.info("no C compiler found: CPU linear layers use torch's float32 matmul")
        return None
    key = hashlib.sha256("\0".join([SOURCE, compiler, *_FLAGS, _machine_key()]).encode()).hexdigest()[:16]
    path = _cache_dir() / f"gemv_bf16_{key}.so"
    try:
        if not path.is_file():
            _build(compiler, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning("could not build the CPU bf16 matrix-vector kernel (%s%s): CPU linear layers use torch's "
                       "float32 matmul", e, (": " + detail.decode(errors="replace")[-500:]) if detail else "")
        return None
    lib.gemv_bf16.restype = None
    lib.gemv_bf16.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                              ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    return lib


def available() -> bool:
    """Whether the kernel runs here (built, or loaded from the cache, on first call)."""
    global _lib, _tried
    if not _tried:
        _tried = True
        _lib = _load() if os.environ.get("TESTBED_CPU_GEMV", "1") != "0" else None
    return _lib is not None


def bf16_shadow(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight [N, K] as contiguous bf16 when it is a float32 CPU matrix whose every value is a bf16 number
    and the kernel is available; else None (the layer keeps torch's matmul)."""
    if weight.dtype != torch.float32 or weight.is_cuda or weight.dim() != 2 or not available():
        return None
    dense = weight if weight.is_contiguous() else weight.t() if weight.t().is_contiguous() else weight.contiguous()
    first = 0 if sys.byteorder == "little" else 1
    low = dense.view(torch.int16)[:, first::2]  # the 16 low bits of each value: zero in a bf16 number
    return None if bool(low.any()) else weight.to(torch.bfloat16).contiguous()


def gemv_bf16(x: torch.Tensor, weight_bf16: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 (M small) @ weight_bf16 [N, K]^T -> [M, N] float32, each output summed in float32."""
    if not available():
        raise RuntimeError("the CPU bf16 matrix-vector kernel is not available (no C compiler, or "
                           "TESTBED_CPU_GEMV=0); use torch's matmul")
    if x.dim() != 2 or x.dtype != torch.float32 or weight_bf16.dtype != torch.bfloat16 \
            or x.shape[1] != weight_bf16.shape[1] or not weight_bf16.is_contiguous():
        raise ValueError(f"gemv_bf16: x {tuple(x.shape)} {x.dtype} must be [M, K] float32 and weight "
                         f"{tuple(weight_bf16.shape)} {weight_bf16.dtype} contiguous [N, K] bfloat16")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight_bf16.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m and n:
        _lib.gemv_bf16(x.data_ptr(), x.stride(0), weight_bf16.data_ptr(), y.data_ptr(), n, m, n, k,
                       torch.get_num_threads())
    return y
