"""transformers' own GGUF tokenizer on a set of texts and conversations, run as its own process.

A separate process because importing PaddleFormers (the ERNIE oracle, imported by other test modules
of the same session) loads transformers with torch hidden, and transformers' GGUF loader needs torch.
Reads {"path", "texts", "drop_ids", "conversations"} as JSON on stdin, writes JSON on stdout:
the ids of each text (no added specials), the text of those ids less `drop_ids` (without
transformers' lossy clean-up of spaces), and the prompt ids of each conversation.
"""

import json
import os
import sys


def main():
    request = json.load(sys.stdin)
    from transformers import AutoTokenizer

    path = request["path"]
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    drop = set(request["drop_ids"])
    encoded = [tok.encode(text, add_special_tokens=False) for text in request["texts"]]
    decoded = [tok.decode([i for i in ids if i not in drop], skip_special_tokens=True,
                          clean_up_tokenization_spaces=False) for ids in encoded]
    chats = []
    for messages in request["conversations"]:
        try:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except ValueError as exc:  # a file without a chat template
            chats.append(str(exc))
            continue
        chats.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    json.dump({"encode": encoded, "decode": decoded, "chat": chats}, sys.stdout)


if __name__ == "__main__":
    main()
