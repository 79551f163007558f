"""Prefill/decode disaggregation: a prefill server computes a prompt's KV, a decode server reads the pages
each head can still use over NIXL and generates (docs/disaggregation.md)."""
