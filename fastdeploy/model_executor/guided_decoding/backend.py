"""The grammar engine behind guided decoding: llguidance (docs/structured_outputs.md says why).

`grammar_of(params)` turns a request's constraint into llguidance's grammar text and checks it
without a tokenizer, so the API server can answer a broken schema or regex with a 400 before the
request reaches the engine. `LLGuidanceBackend` is the engine's: it builds llguidance's tokenizer
once from the engine tokenizer's token bytes, and compiles each grammar once — a matcher in its
start state is cached by the grammar's text, and every request gets a cheap deep copy of it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from functools import lru_cache

from fastdeploy.model_executor.guided_decoding.params import GuidedDecodingParams

logger = logging.getLogger("fastdeploy.guided_decoding")

BACKENDS = ("auto", "llguidance", "guidance", "off")  # guidance: vLLM's name for llguidance
# JSON as OpenAI's structured outputs write it: no whitespace between tokens. Flexible whitespace
# lets a model pad forever; compact output is also fewer tokens.
JSON_OPTIONS = {"whitespace_flexible": False}
ANY_JSON_OBJECT = {"type": "object"}
CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)


def check_backend(name: str) -> str:
    """The backend a `--guided-decoding-backend` value selects ('llguidance' or 'off')."""
    if name in ("auto", "llguidance", "guidance"):
        return "llguidance"
    if name == "off":
        return "off"
    if name == "xgrammar":
        raise ValueError("guided_decoding_backend: xgrammar is not bundled (it needs torch and triton); use auto "
                         "(llguidance)")
    raise ValueError(f"guided_decoding_backend must be one of {', '.join(BACKENDS)}, got {name!r}")


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ValueError("guided decoding needs the llguidance package: pip install llguidance") from None
    return llguidance


@lru_cache(maxsize=CACHE_SIZE)
def _grammar(kind: str, text: str, value=None) -> str:
    llg = _llguidance()
    if kind == "json":
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        except ValueError as exc:  # not JSON text, or not an object
            raise ValueError(f"guided_json: not a JSON schema: {exc}") from None
    elif kind == "json_object":
        grammar = llg.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_OPTIONS)
    elif kind == "regex":
        grammar = llg.LLMatcher.grammar_from_regex(text)
    elif kind == "choice":
        # Each choice is a Lark string literal: JSON string syntax is Lark's (quotes and escapes).
        import json

        grammar = llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    else:  # grammar: Lark, or GBNF converted to Lark
        try:
            grammar = llg.grammar_from("grammar", text)
        except ValueError as exc:
            raise ValueError(f"guided_grammar: {exc}") from None
    error = llg.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"guided_{kind}: the grammar engine cannot compile it: {_one_line(error)}")
    return grammar


def grammar_of(params: GuidedDecodingParams) -> str:
    """llguidance grammar text for `params`, checked; ValueError names the field and the problem."""
    params.validate()
    kind = params.kind()
    value = tuple(params.choice) if kind == "choice" else None
    return _grammar(kind, params.text(), value)


def _one_line(message: str) -> str:
    """llguidance's messages quote the grammar over several lines: keep the first, the cause."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return "; ".join(lines[:4]) if lines else message


def special_piece(tokenizer, token_id: int) -> str:
    piece = tokenizer.id_to_token(token_id) if hasattr(tokenizer, "id_to_token") else None
    return piece or f"<special_{token_id}>"


class _TokenList:
    """What llguidance's TokenizerWrapper reads: every id's bytes (specials as 0xFF + name, which
    no text can produce), the end token, and an encoder for text."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list):
        specials = set(getattr(tokenizer, "special_ids", ())) | set(eos_ids)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(tokenizer, name, None)
            specials |= {value} if isinstance(value, int) else set(value or ())
        self.tokens = []
        for t in range(vocab_size):
            if t in specials:
                self.tokens.append(b"\xff" + special_piece(tokenizer, t).encode("utf-8"))
            else:
                self.tokens.append(tokenizer.token_bytes(t))
        self.special_token_ids = sorted(t for t in specials if 0 <= t < vocab_size)
        self.eos_token_id = eos_ids[0]
        bos = getattr(tokenizer, "bos_token_id", None)
        self.bos_token_id = bos if isinstance(bos, int) else None
        self._encode = tokenizer.encode

    def __call__(self, text) -> list:
        return self._encode(text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text)


class LLGuidanceBackend:
    """One per engine: llguidance's view of the vocabulary, and the compiled-grammar cache."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.vocab_size = vocab_size
        self.eos_ids = sorted({eos_token_ids} if isinstance(eos_token_ids, int) else set(eos_token_ids))
        self._tokenizer = tokenizer
        self._lltokenizer = None  # built at the first constrained request (a vocabulary walk)
        self._compiled: OrderedDict = OrderedDict()
        self.compile_seconds_total = 0.0
        self.tokenizer_build_seconds = None
        self.cache_hits = self.cache_misses = 0

    @property
    def lltokenizer(self):
        if self._lltokenizer is None:
            llg = _llguidance()
            start = time.perf_counter()
            tokens = _TokenList(self._tokenizer, self.vocab_size, self.eos_ids)
            self._lltokenizer = llg.LLTokenizer(llg.TokenizerWrapper(tokens), n_vocab=self.vocab_size,
                                                eos_token=self.eos_ids)
            self.tokenizer_build_seconds = time.perf_counter() - start
            logger.info("guided decoding: llguidance %s tokenizer over %d tokens built in %.2f s", llg.__version__,
                        self.vocab_size, self.tokenizer_build_seconds)
        return self._lltokenizer

    def matcher(self, params: GuidedDecodingParams):
        """A fresh llguidance matcher for one request (ValueError if the grammar cannot compile)."""
        llg = _llguidance()
        grammar = grammar_of(params)
        cached = self._compiled.get(grammar)
        if cached is None:
            self.cache_misses += 1
            tokenizer = self.lltokenizer  # built once, not counted as compile time
            start = time.perf_counter()
            cached = llg.LLMatcher(tokenizer, grammar, log_level=0)
            self.compile_seconds_total += time.perf_counter() - start
            if cached.is_error():
                raise ValueError(f"guided_{params.kind()}: the grammar engine cannot compile it: "
                                 f"{_one_line(cached.get_error())}")
            self._compiled[grammar] = cached
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self.cache_hits += 1
            self._compiled.move_to_end(grammar)
        return cached.deep_copy()

    def grammar_state(self, params):
        """The GrammarState of a request with SamplingParams `params` (its grammar compiled or cached)."""
        from fastdeploy.model_executor.guided_decoding.masks import GrammarState

        return GrammarState(self.matcher(params.guided_decoding), self.vocab_size, self.eos_ids,
                            params.stop_token_ids or ())
