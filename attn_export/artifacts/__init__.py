"""Stage 3, the artifacts: files written atomically under a lock, golden vectors, the
manifest, and safe reading of ONNX files that may come from anywhere."""
