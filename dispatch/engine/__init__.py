"""Running: the dispatcher, its plans, the torch custom ops, first-use checks, blame.

From the top: `dispatcher` (`Dispatcher`'s public calls), `torch_ops` (the custom ops
that ``torch.compile`` traces and CUDA graphs capture), `inductor` (the W4A16 op's rule
that lets a compiled graph launch the plan's kernels itself), `op_fast` (the W4A16 op's
kept fast calls, what an opaque compiled call pays), `runner` (`Runner`, the engine of
one device: plans, fallback, tuning on request), `blame` (whose fault a failure is),
`firstuse` (the first-use check of third-party kernels), `capture` (the capture state)
and `plans` (what one exact shape runs, with its replayable launches). Each imports only
those after it (a contract in pyproject.toml); the package imports `store` and below.
"""
