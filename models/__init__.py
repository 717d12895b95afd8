"""The RVQ codec on vector-quantize-pytorch, its metrics, and encoding features to codes."""
