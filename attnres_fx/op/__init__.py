"""The operator AttnRes adds: the module injected at each site (``module``), the aggregation's PyTorch
formulations (``aggregation``), the fused operator ``torch.ops.attnres.aggregate`` (``ops``) and its C++ and
Triton kernels (``kernels``)."""
