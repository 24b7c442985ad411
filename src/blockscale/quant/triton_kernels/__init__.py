"""Triton kernels for the block quantizers (optional: ``pip install blockscale[triton]``).

Importing this package never fails: ``TRITON_AVAILABLE`` says whether ``triton`` imports. The
kernel modules (e.g. ``nvfp4_triton``) import triton and are loaded lazily by the dispatchers.
Kernels are bit-identical to the eager reference; on CPU they can run under Triton's interpreter
(``TRITON_INTERPRET=1``, set before triton is imported), which is how the tests check them.
"""
from __future__ import annotations

try:  # any failure (missing package, broken install) just means "no Triton"
    import triton

    TRITON_AVAILABLE, TRITON_VERSION = True, triton.__version__
except Exception:  # noqa: BLE001
    TRITON_AVAILABLE, TRITON_VERSION = False, None

__all__ = ["TRITON_AVAILABLE", "TRITON_VERSION"]
