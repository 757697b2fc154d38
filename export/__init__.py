"""Hand-off of rewritten modules to torch.compile (Inductor) and ONNX / onnxruntime."""
