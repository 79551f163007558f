"""Synthetic long-context retrieval samples for the gate finder: facts hidden in the calibration share of
`pydoc_data.topics` (calibration_text.py), a question at the end, and the answer the model must give.

Written for training only: the facts ("the archive number of <name> is <digits>"), their wording and the
filler prose differ from the evaluation's pass keys and door codes (benchmarks/eval_swa_quality.py,
written sentences) and from its held-out text, so the evaluation measures heads the finder never saw.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastdeploy.tools.calibration_text import calibration_text

NAMES = ("Alder", "Birch", "Cedar", "Juniper", "Larch", "Maple", "Rowan", "Willow", "Hazel", "Spruce",
         "Linden", "Aspen")


@dataclass
class Sample:
    ids: list  # prompt + answer token ids
    answer_rows: list  # positions whose next token is an answer token (where the loss looks)
    answer: str


class RetrievalSamples:
    """Samples of about `length` tokens; each asks for one of 1..max_facts facts at random depths."""

    def __init__(self, tokenizer, length: int, max_facts: int = 3):
        self.tok = tokenizer
        self.length = length
        self.max_facts = max_facts
        self.filler = tokenizer.encode(calibration_text()[:length * 40], add_special_tokens=False)
        if len(self.filler) < 2 * length:
            raise ValueError(f"the calibration text holds {len(self.filler)} tokens, too few for "
                             f"{length}-token samples")
        template = getattr(tokenizer, "chat_template", None)
        if template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "@@DOC@@"}], tokenize=False,
                                                 add_generation_prompt=True)
            before, after = text.split("@@DOC@@")
        else:
            before, after = "", "\n\n"
        self.before = tokenizer.encode(before, add_special_tokens=True)  # <bos> where the model wants one
        self.after = tokenizer.encode(after, add_special_tokens=False)

    def _encode(self, text: str) -> list:
        return self.tok.encode(text, add_special_tokens=False)

    def sample(self, rng: np.random.Generator) -> Sample:
        count = int(rng.integers(1, self.max_facts + 1))
        names = [NAMES[i] for i in rng.choice(len(NAMES), size=count, replace=False)]
        numbers = [str(rng.integers(1000, 1000000)) for _ in names]
        asked = int(rng.integers(count))
        intro = self._encode("Below is an excerpt of a reference manual with a few archive numbers in it.\n\n")
        facts = [self._encode(f" (The archive number of {n} is {x}.) ") for n, x in zip(names, numbers)]
        question = self._encode(f"\n\nWhat is the archive number of {names[asked]}?")
        prefix = self._encode(f"The archive number of {names[asked]} is")
        answer = self._encode(f" {numbers[asked]}.")
        fixed = len(self.before) + len(intro) + sum(map(len, facts)) + len(question) + len(self.after) \
            + len(prefix) + len(answer)
        body = self.length - fixed
        if body < 16:
            raise ValueError(f"--seq-tokens {self.length} is too short for a retrieval sample")
        start = int(rng.integers(len(self.filler) - body))
        doc = list(self.filler[start:start + body])
        spots = sorted((int(rng.integers(body + 1)) for _ in facts), reverse=True)
        for spot, fact in zip(spots, facts):  # from the back, so the earlier spots stay put
            doc[spot:spot] = fact
        prompt = self.before + intro + doc + question + self.after + prefix
        first = len(prompt) - 1
        return Sample(prompt + answer, list(range(first, first + len(answer))), numbers[asked])
