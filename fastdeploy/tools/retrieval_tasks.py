"""Retrieval prompts that install everywhere, in two splits that never meet.

- **calibration** (what the head finder and the window menu may look at, and what chose configurations
  before 2026-12-05): a pass key or door codes hidden in repeated filler sentences written here, at the
  depths asked, in the model's chat template;
- **evaluation** (what every shipped claim is measured on): "special magic numbers" for words (several
  needles, one asked: the key-value form of RULER's needle-in-a-haystack) or one access number (the
  passkey form), hidden in the held-out part of `pydoc_data.topics` (calibration_text.py), each needle at
  its own depth, in the chat template or as plain completion. Other text, other phrasing, other seeds.

Depths are fractions of the document; `RANDOM_DEPTH` draws the asked needle's depth uniformly from
[0.05, 0.95] per prompt. Every prompt is seeded by its split, shape and trial, so a rerun asks the same.
"""

from __future__ import annotations

import hashlib

import numpy as np

from fastdeploy.tools.calibration_text import calibration_text, held_out_text

SPLITS = ("calibration", "evaluation")
VARIANTS = {"calibration": ("passkey", "multikey"), "evaluation": ("magic", "accesskey")}
RANDOM_DEPTH = "random"
DEPTH_RANGE = (0.05, 0.95)
FILLER_SENTENCES = (
    "The morning train left the valley on time, as it does every day.",
    "A baker on the corner sold warm bread to the people walking past.",
    "Clouds drifted over the fields and the wind moved the tall grass.",
    "Children played by the river while their parents talked on the bank.",
    "The library closed at six, and the last readers went home slowly.",
)
COLORS = ("red", "green", "blue", "yellow", "white", "black", "orange", "purple")
# Keys of the evaluation split's magic numbers: plain nouns, none of them a word of the calibration tasks.
WORDS = ("anchor", "violin", "harbor", "pepper", "lantern", "meadow", "copper", "falcon", "saddle", "orchid",
         "glacier", "tunnel", "marble", "walnut", "compass", "kettle", "thunder", "ribbon", "canyon", "pillow")

# The one-needle forms, as data: (key range, intro, needle, question, answer prefix). passkey is the
# calibration split's, accesskey the evaluation split's (other phrasing, other text around it).
ONE_NEEDLE = {
    "passkey": ((10000, 100000), "There is a pass key hidden in the text below. Find it and remember it.\n\n",
                " The pass key is {key}. Remember it: {key} is the pass key. ",
                "\n\nWhat is the pass key? Answer with the number only.", "The pass key is"),
    "accesskey": ((1_000_000, 10_000_000), "An access number is written somewhere in the text below. Keep it in "
                  "mind.\n\n", " Note for the reader: the access number is {key}. ",
                  "\n\nWhat is the access number written in the text?", "The access number is"),
}


class RetrievalTask:
    """Prompts of about `length` tokens with facts hidden at depths, for one split."""

    def __init__(self, tokenizer, split: str):
        if split not in SPLITS:
            raise ValueError(f"unknown retrieval split {split!r}; choose one of {', '.join(SPLITS)}")
        self.tok, self.split = tokenizer, split
        before, after = tokenizer.apply_chat_template([{"role": "user", "content": "@@DOC@@"}]).split("@@DOC@@")
        self.chat_before, self.chat_after = tokenizer.encode(before), tokenizer.encode(after)
        if split == "calibration":
            self.filler = tokenizer.encode(" ".join(FILLER_SENTENCES * 400))
        else:
            self.filler = tokenizer.encode(held_out_text()[:200_000])

    def prompt(self, variant: str, length: int, depth, rng: np.random.Generator, chat: bool = True) -> tuple:
        """(token ids, expected answer, the asked needle's depth)."""
        depth = float(rng.uniform(*DEPTH_RANGE)) if depth == RANDOM_DEPTH else float(depth)
        enc = self.tok.encode
        if variant in ONE_NEEDLE:
            (low, high), intro, needle, question, answer_prefix = ONE_NEEDLE[variant]
            answer = str(rng.integers(low, high))
            intro, question, answer_prefix = enc(intro), enc(question), enc(answer_prefix)
            needles = [(depth, enc(needle.format(key=answer)))]
        elif variant == "multikey":
            colors = rng.choice(len(COLORS), size=3, replace=False)
            keys = [str(rng.integers(10000, 100000)) for _ in colors]
            asked = int(rng.integers(3))
            spots = [depth, (depth + 0.33) % 1.0, (depth + 0.66) % 1.0]  # the asked one at `depth`
            order = [asked] + [i for i in range(3) if i != asked]
            intro = enc("Read the document below. It contains codes for several doors.\n\n")
            needles = [(spots[n], enc(f"\nThe code for the {COLORS[colors[i]]} door is {keys[i]}.\n"))
                       for n, i in enumerate(order)]
            question = enc(f"\n\nWhat is the code for the {COLORS[colors[asked]]} door? Answer with the number only.")
            answer_prefix, answer = enc(f"The code for the {COLORS[colors[asked]]} door is"), keys[asked]
        elif variant == "magic":
            words = [WORDS[i] for i in rng.choice(len(WORDS), size=3, replace=False)]
            numbers = [str(rng.integers(1_000_000, 10_000_000)) for _ in words]
            # The asked needle at `depth`, the two others each at a depth of its own.
            spots = [depth] + [float(rng.uniform(*DEPTH_RANGE)) for _ in words[1:]]
            intro = enc("Some special magic numbers are hidden within the following text. Make sure to memorize "
                        "them. I will quiz you about the numbers afterwards.\n\n")
            needles = [(spot, enc(f" One of the special magic numbers for {w} is: {n}. "))
                       for spot, w, n in zip(spots, words, numbers)]
            question = enc(f"\n\nWhat is the special magic number for {words[0]} mentioned in the provided text?")
            answer_prefix = enc(f"The special magic number for {words[0]} mentioned in the provided text is")
            answer = numbers[0]
        else:
            raise ValueError(f"unknown retrieval variant {variant!r}")
        before, after = (self.chat_before, self.chat_after) if chat else ([], enc("\n\n"))
        fixed = len(before) + len(intro) + sum(len(n) for _, n in needles) + len(question) + len(after) \
            + len(answer_prefix)
        body = length - fixed
        if body < 16:
            raise ValueError(f"context length {length} is too short for the {variant} prompt")
        start = int(rng.integers(len(self.filler)))
        doc = [self.filler[(start + i) % len(self.filler)] for i in range(body)]
        for spot, needle in sorted(needles, key=lambda x: -x[0]):  # from the back: earlier spots stay put
            at = int(round(spot * body))
            doc = doc[:at] + needle + doc[at:]
        return before + intro + doc + question + after + answer_prefix, answer, depth

    def prompts(self, variants, lengths, depths, trials: int, seed: int = 0, chat_forms=(True,)) -> list:
        """One dict per prompt: variant, chat, length, depth (the grid's, or RANDOM_DEPTH), asked depth, ids,
        answer."""
        wrong = [v for v in variants if v not in VARIANTS[self.split]]
        if wrong:
            raise ValueError(f"variant(s) {wrong} are not of the {self.split} split ({', '.join(VARIANTS[self.split])})")
        out = []
        for variant in variants:
            for chat in chat_forms:
                for length in lengths:
                    for depth in depths:
                        for trial in range(trials):
                            key = f"{self.split}|{variant}|{chat}|{length}|{depth}|{trial}|{seed}"
                            rng = np.random.default_rng(int(hashlib.sha256(key.encode()).hexdigest()[:12], 16))
                            ids, answer, at = self.prompt(variant, length, depth, rng, chat)
                            out.append({"variant": variant, "chat": chat, "length": length, "depth": depth,
                                        "asked_depth": at, "ids": ids, "answer": answer})
        return out


def found(answer: str, text: str) -> bool:
    """Whether a generated text gives the answer (digits compared without the spaces a tokenizer adds)."""
    return answer in text.replace(" ", "")


def depth_band(depth: float, bands: int = 4) -> str:
    """'0.05-0.28' ...: which of `bands` equal parts of DEPTH_RANGE a depth falls in."""
    lo, hi = DEPTH_RANGE
    k = min(bands - 1, max(0, int((depth - lo) / (hi - lo) * bands)))
    width = (hi - lo) / bands
    return f"{lo + k * width:.2f}-{lo + (k + 1) * width:.2f}"


def calibration_prose() -> str:
    """Prose of the calibration split, for tools that hide needles in text of their own."""
    return calibration_text()
