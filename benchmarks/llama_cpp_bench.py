"""llama.cpp's `llama-batched-bench` on a GGUF file, for the benchmarks that put it beside this engine.

llama.cpp is built from the source that `llama-cpp-python`'s source distribution carries (nothing of
it is committed); docs/benchmarks.md gives the build commands. The bench decodes N sequences of
`prompt_len` prompt tokens and `output_len` generated tokens at once and prints a table whose columns
are PP, TG, B, N_KV, T_PP s, S_PP t/s, T_TG s, S_TG t/s, T s, S t/s.
"""

from __future__ import annotations

import subprocess


def batched_bench(binary: str, gguf: str, prompt_len: int, output_len: int, parallel: int,
                  threads: int = 2) -> dict:
    """{"seconds": the whole run (prefill + decode), "prefill_seconds", "decode_tok_s"} of one bench run."""
    context = parallel * (prompt_len + output_len) + 64
    out = subprocess.run([binary, "-m", gguf, "-c", str(context), "-b", "2048", "-ub", "512",
                          "-npp", str(prompt_len), "-ntg", str(output_len), "-npl", str(parallel),
                          "-t", str(threads)], capture_output=True, text=True, timeout=1800, check=True).stdout
    rows = [line.split("|") for line in out.splitlines()
            if line.startswith("|") and line.split("|")[1].strip().isdigit()]
    if not rows:
        raise RuntimeError(f"llama-batched-bench printed no result row:\n{out[-2000:]}")
    row = [cell.strip() for cell in rows[-1]]
    return {"seconds": float(row[9]), "prefill_seconds": float(row[5]), "decode_tok_s": float(row[8])}
