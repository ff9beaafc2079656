"""Stage 2, the export: instantiate the spec's module, export it to ONNX, check the graph,
and derive graph variants."""
