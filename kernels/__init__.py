"""tandem's Triton kernels, one per module, each with its launcher and its torch reference:

- ``kv_cache_write``: each step's K and V into their paged slots (slot -1 skipped);
- ``paged_decode_attention``: one query token per sequence, GQA, flash-decoding split;
- ``paged_prefill_attention``: variable-length causal chunks over a paged, maybe cached, context;
- ``fused_rmsnorm``: RMSNorm with the residual add fused in front (the models' norm on CUDA,
  ``tandem.models.cuda_fusion``);
- ``fp8_matmul``, ``int4_dequant_gemm``: the quantized linear layers' matmuls.

Importing a kernel module imports triton and defines its kernels; to run them on a CPU (tests
only: it is slow), ``TRITON_INTERPRET=1`` must be set before triton is first imported.
"""
