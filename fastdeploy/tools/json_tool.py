"""The shape of a head-finding tool's command line: build a JSON document from the parsed arguments and
write it to `--out`; a ValueError is the user's mistake, printed as one `error:` line with exit code 2."""

from __future__ import annotations

import json
import sys


def run(name: str, args, build) -> int:
    try:
        doc = build(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    print(f"[{name}] wrote {args.out}")
    return 0
