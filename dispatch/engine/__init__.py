"""Running: the dispatcher, its plans, the torch custom ops, first-use checks, blame.

Running: the `dispatcher` (one per device: plans, tuning on request, the public
calls), `plans` (what one exact shape runs, with its replayable launches), the torch
custom ops that ``torch.compile`` traces and CUDA graphs capture (`torch_ops`), the
first-use check of third-party kernels (`firstuse`) and whose fault a failure is
(`blame`). Imports `store` and below."""
