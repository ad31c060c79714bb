"""The fused EP MoE megakernel: dispatch -> grouped SwiGLU GEMM -> down GEMM -> combine in one
persistent launch, synchronised at tile granularity (the layout stage is a separate launch).

Programs take tasks from one ordered queue (an atomic ticket counter). Stages, in queue order:
  S0 dispatch_send   (dest d, chunk c): stage the chunk's tokens on d, stamp flag (me, c) on d
  S1 dispatch_recv   (source s, chunk c): wait that flag; for every (token, k) of the chunk
                     routed here write the GEMM row's gather index (no data copy) and count the
                     row into its GEMM row tile (local counter)
  S2 gemm_gate_up    (row tile i, col tile j): wait until all rows of tile i are placed; SwiGLU
  S3 gemm_down       (row tile i, col tile j): wait for all gate-up tiles of row tile i; down
                     GEMM; the tile's rows go straight to their token's rank, landing at
                     [token, k] (+1 on that (token, k)'s counter there)
  S4 combine_reduce  (token block): wait until every routed (token, k) has all its column
                     tiles; out[t] = sum_k w[t, k] * y(t, k) in fp32, k in order; cast once
A task only waits on earlier tasks of its own rank or on other ranks' tasks of earlier stages,
so a GPU never deadlocks (every awaited task was handed out first and is running) and the
interpreter, which runs one program's whole queue in order, never waits on work not yet done.
Every position is a pure function of the routing and no tile is split along K, so the result
does not depend on which program runs what, on the grid size, on the task order within a
stage, or on `schedule="sequential"` (stage barriers from the plan): bit for bit.
"""
