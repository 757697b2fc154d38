"""Capture: a model (or one block call) turned into the graph the passes read: the conversion's recorded
call (``recording``), TorchDynamo, torch.fx and torch.export (``tracers``), a block with its sublayers as
calls (``block_tracer``)."""
