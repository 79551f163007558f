"""Guided decoding (structured outputs): a request's output is held to a JSON schema, a regex, a
list of choices or a grammar by masking, at every sampled row, the tokens the grammar forbids.

params.py   GuidedDecodingParams, the request-side description (upstream FastDeploy's fields)
backend.py  llguidance: grammar text and its request-time check, the tokenizer, the compile cache
masks.py    a request's matcher, and each step's masks computed beside the forward pass
docs/structured_outputs.md is the user's page.
"""

from fastdeploy.model_executor.guided_decoding.params import GuidedDecodingParams

__all__ = ["GuidedDecodingParams"]
