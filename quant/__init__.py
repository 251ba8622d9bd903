"""Quantized linear layers, registered as quant-method plugins (``tandem.quant.plugin``):

- ``unquantized``: dense weights (the default);
- ``gptq``: AutoGPTQ / GPTQModel checkpoints, 4- and 8-bit, v1 and v2 zero points, desc_act;
- ``awq``: AutoAWQ GEMM checkpoints, 4-bit;
- ``fp8``: float8_e4m3fn weights with per-tensor, per-channel or block scales;
- ``compressed-tensors``: compressed-tensors' FP8 "float-quantized" checkpoints;
- ``gguf``: a llama.cpp GGUF file's blocks kept packed (``gguf_blocks``: their torch dequantizer).

``packing`` holds the int4/int8 word packing, ``sharding`` what the methods share for fused
projections, and ``quantize`` the offline quantizer behind ``tandem quantize``.
"""
