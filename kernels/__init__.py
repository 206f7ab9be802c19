"""astrai.kernels: attention and rotary kernels (pure-torch reference; flash-attn backend on CUDA)."""
