"""Quantization settings (upstream FastDeploy's module path); here only the KV cache's."""
