"""Triton kernels. Importing a kernel module runs `triton.jit`, so import `ditron_ep` first."""
