"""The Hopper (sm90) family's kernels; `fp4_dispatch.plugins.sm90` registers them.

This package holds kernels only: Triton and Gluon code and the kernel objects that
launch it. What is offered, when, and at what estimated cost is the plugin's. Each kernel
module ``backends/sm90/<kernel>.py`` has its test ``tests/test_<kernel>.py``; the plugin
module that offers it (``plugins/sm90/<plugin>.py``) and the backend name:

=====================  =====================  ======================
kernel module          plugin module          backend
=====================  =====================  ======================
``gemm_direct``        ``__init__``           ``triton-sm90``
``gemm_unpack``        ``__init__``           ``triton-sm90-unpack``
``gemm_w4a16``         ``w4a16``              ``triton-sm90-w4a16``
``gemm_w4a16_decode``  ``w4a16`` (gemv path)  ``triton-sm90-w4a16``
``gemm_w4a4_dense``    ``dense``              ``triton-sm90-dense``
``gemm_w4a16_ws``      ``ws``                 ``triton-sm90-ws``
``gemm_w4a16_mma``     ``mma``                ``triton-sm90-mma``
``expand_rows``        ``mma`` (W4A4)         ``triton-sm90-mma``
``gemm_w4a16_rs``      ``rs``                 ``triton-sm90-rs``
``gemm_w4a8``          ``w4a8``               ``triton-sm90-w4a8``
``splitk``             (shared)               the Triton GEMMs above
``swizzle``            (shared)               the Triton GEMMs above
``epilogue_gluon``     (shared)               ws, mma, rs (Gluon)
=====================  =====================  ======================

The W4A4 kernels' cost model is ``plugins/sm90/cost_model.py``; every fitted sm90
constant is in ``plugins/sm90/cost_model.json``.
"""
