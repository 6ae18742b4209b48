"""Compute: the CPU expert backends and their registry (the reference loop, the grouped torch
products, kt-ft's native C++ kernels of ``kernels/`` through ctypes, kt-kernel), the GPU grouped
products, the quantized formats with their dequantizers, and the fused LoRA linear, RMSNorm,
rotary and chunked loss. Tensors in, tensors out: no placement, no model surgery.
"""
