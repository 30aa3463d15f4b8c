/* FlashAttention-compatible kernels: being written. */
