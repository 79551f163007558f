"""A request's structured-output fields -> GuidedDecodingParams, checked when the request arrives.

OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema":
{"name", "schema", "strict"}}) and the `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` / `guided_json_object` fields of upstream FastDeploy and vLLM say the same thing;
at most one may be given. The grammar is built and checked here, in the API server, so a schema or
regex the grammar engine cannot compile is a 400 naming the problem before the engine sees it.
"""

from __future__ import annotations

from typing import Optional

from fastdeploy.model_executor.guided_decoding.backend import grammar_of
from fastdeploy.model_executor.guided_decoding.params import GuidedDecodingParams

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar", "guided_json_object": "json_object"}
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def _from_response_format(response_format: Optional[dict]) -> Optional[GuidedDecodingParams]:
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise ValueError(f"response_format: type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecodingParams(json_object=True)
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError("response_format: type json_schema needs a json_schema object "
                         '({"name": ..., "schema": {...}, "strict": true})')
    schema = spec.get("schema")
    if schema is None:  # OpenAI allows a json_schema without a schema: any JSON object
        return GuidedDecodingParams(json_object=True)
    if not isinstance(schema, dict):
        raise ValueError("response_format: json_schema.schema must be a JSON object (a JSON schema)")
    return GuidedDecodingParams(json=schema)


def guided_decoding_of(request) -> Optional[GuidedDecodingParams]:
    """The request's constraint (None: free text). Raises ValueError naming the field and the problem:
    two constraints at once, a wrong shape, or a grammar llguidance cannot compile."""
    given = {name: getattr(request, name) for name in GUIDED_FIELDS if getattr(request, name, None) is not None}
    if given.get("guided_json_object") is False:
        del given["guided_json_object"]
    from_format = _from_response_format(getattr(request, "response_format", None))
    if from_format is not None:
        given["response_format"] = from_format
    if len(given) > 1:
        raise ValueError(f"give at most one of response_format (json_object / json_schema) and "
                         f"{', '.join(GUIDED_FIELDS)}; got {', '.join(given)}")
    if not given:
        return None
    (name, value), = given.items()
    params = value if name == "response_format" else GuidedDecodingParams(**{GUIDED_FIELDS[name]: value})
    try:
        grammar_of(params)  # raises ValueError("guided_json: ...") for what cannot compile
    except ValueError as exc:
        if name != "response_format":
            raise
        raise ValueError("response_format: " + str(exc).split(": ", 1)[-1]) from None
    return params
