"""Writes the jsonl data of the lm-evaluation-harness tasks in this folder, from local prose only.

The text is Python's own documentation topics (`pydoc_data.topics`, shipped with every CPython), so
the tasks run where hub data sets cannot be reached. Every context is long enough to reach past a
512-token sliding window (~4 characters per token), which is what a head-wise configuration changes:

- pydoc_next_sentence (multiple_choice, loglikelihood): a ~2,600-character passage, then which of
  four sentences comes next (the true one, three from other topics);
- pydoc_perplexity (loglikelihood_rolling): whole ~6,000-character documents, word perplexity;
- pydoc_recall (generate_until): a ~3,000-character passage, then a run of its words from ~400
  characters in (past a 64-token sink) again; the model continues with the four words that followed
  them there (copying from ~650 tokens back);
- pydoc_needles (generate_until): the evaluation split's retrieval prompts (fastdeploy/tools/
  retrieval_tasks.py) as plain completion: special magic numbers (several needles, one asked) and an
  access number, hidden in held-out pydoc prose at depths 0.05 to 0.95, ~1k and ~1.9k tokens of
  `--needles-model`'s tokenizer; the model completes the number.

Usage (from the repository root): python benchmarks/lm_eval_tasks/make_data.py [--out DIR] [--needles-model M]
The choice of passages is seeded, so the files are the same for the same Python version.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re

HERE = os.path.dirname(os.path.abspath(__file__))
PASSAGE_CHARS = 2600
RECALL_CHARS, CUE_FROM = 3000, 400  # pydoc_recall: ~750-token passages, the cue from ~100 tokens in
DOC_CHARS = 6000
SENTENCE = re.compile(r"(?<=[a-z0-9)][.!?])\s+(?=[A-Z])")


def topics() -> list:
    from pydoc_data.topics import topics as all_topics

    return [(name, all_topics[name].strip()) for name in sorted(all_topics)]


def prose_sentences(text: str) -> list:
    """(start, sentence) of prose sentences of 40-200 characters within a paragraph (no code, no markup)."""
    out, at = [], 0
    for piece in SENTENCE.split(text):
        start = text.index(piece, at)
        at = start + len(piece)
        if 40 <= len(piece) <= 200 and "\n\n" not in piece and not piece.startswith(" ") and piece[-1] in ".!?" and not re.search(r"[*=>`|]", piece):
            out.append((start, piece))
    return out


def next_sentence_items(rng: random.Random, n: int) -> list:
    pool = {name: prose_sentences(text) for name, text in topics()}
    texts = dict(topics())
    candidates = [(name, start, s) for name, sents in pool.items() for start, s in sents
                  if PASSAGE_CHARS <= start and texts[name][start - 1] in " \n"]
    rng.shuffle(candidates)
    items, per_topic = [], {}
    for name, start, sentence in candidates:
        if per_topic.get(name, 0) == 3:
            continue  # spread the items over many topics
        per_topic[name] = per_topic.get(name, 0) + 1
        context = texts[name][start - PASSAGE_CHARS:start].rstrip()
        others = [s for other, sents in pool.items() if other != name for _, s in sents]
        choices = rng.sample(others, 3) + [sentence]
        rng.shuffle(choices)
        items.append({"topic": name, "context": context, "choices": choices, "gold": choices.index(sentence)})
        if len(items) == n:
            break
    return items


def perplexity_docs(n: int) -> list:
    docs = []
    for name, text in topics():
        paragraphs = text.split("\n\n")
        doc = ""
        for p in paragraphs:
            doc = f"{doc}\n\n{p}" if doc else p
            if len(doc) >= DOC_CHARS:
                docs.append({"topic": name, "text": doc})
                doc = ""
    return docs[:n]


def recall_items(rng: random.Random, n: int) -> list:
    """A passage, then a run of its words from past the sink (~100 tokens in), which lies ~650 tokens
    before the repeat: outside a 512-token window; the target is the four words that followed it."""
    items = []
    for name, text in topics():
        last = -RECALL_CHARS
        for first, _ in prose_sentences(text):
            if first + RECALL_CHARS + 400 > len(text):
                break
            if first < last + RECALL_CHARS:
                continue  # a topic's two passages do not overlap
            last = first
            passage = text[first:first + RECALL_CHARS]
            words = [w for w in re.finditer(r"\S+", passage) if w.start() >= CUE_FROM]
            # The cue: 20+ words, up to a word whose next four follow on the same line.
            for k in range(20, 40):
                cue_end = words[k - 1].end()
                rest = words[k:k + 4]
                if len(rest) == 4 and "\n" not in passage[cue_end:rest[-1].end()]:
                    break
            else:
                continue
            items.append({"topic": name, "context": passage.rstrip() + "\n\n" + passage[words[0].start():cue_end],
                          "target": " ".join(w.group() for w in rest)})
            if sum(item["topic"] == name for item in items) == 2:
                break  # two per topic at most
    rng.shuffle(items)
    return items[:n]


NEEDLE_LENGTHS = (1024, 1900)  # tokens: within lm-eval's max_length 2048 with the answer's room
NEEDLE_DEPTHS = (0.05, 0.25, 0.5, 0.75, 0.95)


def needle_items(model: str) -> list:
    """pydoc_needles: evaluation-split retrieval prompts, plain completion, decoded to text by the model's
    tokenizer (so their lengths are that model's tokens)."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository, when run from a checkout
    from fastdeploy.config import ModelConfig
    from fastdeploy.input.tokenizer_loader import load_tokenizer
    from fastdeploy.tools.retrieval_tasks import VARIANTS, RetrievalTask

    tokenizer = load_tokenizer(ModelConfig.create(model, None, None))
    prompts = RetrievalTask(tokenizer, "evaluation").prompts(VARIANTS["evaluation"], NEEDLE_LENGTHS, NEEDLE_DEPTHS,
                                                             trials=2, chat_forms=(False,))
    return [{"context": tokenizer.decode(p["ids"]), "target": p["answer"], "variant": p["variant"],
             "length": p["length"], "depth": p["depth"]} for p in prompts]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(HERE, "data"), help="folder for the jsonl files")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--needles-model", default="smollm2-135m-instruct",
                        help="the model whose tokenizer sizes pydoc_needles' prompts (a name, directory or GGUF)")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rng = random.Random(args.seed)
    sets = {"pydoc_next_sentence": next_sentence_items(rng, 12), "pydoc_perplexity": perplexity_docs(8),
            "pydoc_recall": recall_items(rng, 12), "pydoc_needles": needle_items(args.needles_model)}
    for name, rows in sets.items():
        with open(os.path.join(args.out, f"{name}.jsonl"), "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"{name}: {len(rows)} documents -> {os.path.join(args.out, name + '.jsonl')}")


if __name__ == "__main__":
    main()
