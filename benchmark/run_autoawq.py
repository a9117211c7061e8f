"""AutoAWQ (the peer of `lmkit lite awq`) on given calibration windows, in the interpreter that has it.

    PYTHON_WITH_AUTOAWQ benchmark/run_autoawq.py SOURCE WINDOWS.json OUT --group-size 64

Run by `benchmark/eval_awq.py --autoawq-python PY`, which writes WINDOWS.json (lmkit's own calibration
windows, token ids [samples][seqlen]) so that both tools see the same text, and then scores OUT with
lmkit's torch perplexity path. AutoAWQ 0.2.9 (the last release; upstream has deprecated it) needs
transformers 4.51 (it imports Qwen3 classes and helpers later releases removed), so it lives in its own
environment, e.g.:

    python -m venv /tmp/awqvenv
    /tmp/awqvenv/bin/pip install torch==2.13.0   # pinned first: an unpinned torch pulls the CUDA wheels
    /tmp/awqvenv/bin/pip install --no-deps autoawq==0.2.9
    /tmp/awqvenv/bin/pip install "transformers==4.51.3" "tokenizers>=0.21,<0.22" zstandard "datasets<4" accelerate \
        torch==2.13.0

As shipped it writes a broken checkpoint on the CPU: its quantizer keeps the block's weights before a scale
candidate as `{k: v.cpu() ...}`, which on the CPU is the same tensor, so the in-place scaling is never undone
(perplexity ~116,000 on SmolLM2). This script applies the one-line fix (a copy) before quantizing and says so.
transformers 4.51 also misreads a transformers-5 config's rope_parameters (it falls back to rope_theta
10000), so the model is loaded from a copy of the config that spells rope_theta the 4.x way as well.
"""

from __future__ import annotations

import argparse
import inspect
import json
import shutil
import sys
import time
from pathlib import Path


def fix_cpu_state_copy() -> bool:
    """Patches the AwqQuantizer method that saves the block's state before a scale candidate (``_compute_best_scale``
    in 0.2.9's last source, ``_search_best_scale`` in earlier ones) so the saved state dict is a copy; False if no
    method holds the bug. SystemExit if the module's file still holds it where no method was patched (a checkpoint
    quantized so would be broken: perplexity ~10^5)."""
    from awq.quantize import quantizer

    bug = "org_sd = {k: v.cpu() for k, v in module2inspect.state_dict().items()}"
    import textwrap

    patched = False
    for name in ("_compute_best_scale", "_search_best_scale"):
        method = getattr(quantizer.AwqQuantizer, name, None)
        source = inspect.getsource(method) if method is not None else ""
        if bug not in source:
            continue
        fixed = textwrap.dedent(source).replace(
            bug, "org_sd = {k: v.cpu().clone() for k, v in module2inspect.state_dict().items()}")
        namespace: dict = {}
        exec(compile(fixed, quantizer.__file__, "exec"), quantizer.__dict__, namespace)
        setattr(quantizer.AwqQuantizer, name, namespace[name])
        patched = True
    if not patched and bug in Path(quantizer.__file__).read_text():
        raise SystemExit(f"{quantizer.__file__} saves the block's state without a copy in a method this script does "
                         "not patch: its checkpoint would be broken on a CPU")
    return patched


def legacy_rope_source(source: Path, scratch: Path) -> Path:
    """``source``, or a copy of it (weights linked) whose config also has the 4.x top-level ``rope_theta``.
    transformers 4.51 does not read 5.x's ``rope_parameters``: on a 5.x config it silently uses its default
    rope_theta 10000 (SmolLM2 has 100000), so AutoAWQ would calibrate and search scales on a model with the
    wrong rotary base, and save that 10000 beside the real value."""
    cfg = json.loads((source / "config.json").read_text())
    params = cfg.get("rope_parameters") or {}
    if "rope_theta" not in params or cfg.get("rope_theta") == params["rope_theta"]:
        return source
    if params.get("rope_type", "default") != "default":
        raise SystemExit(f"{source}: rope_parameters {params} have no transformers-4.51 spelling here")
    scratch.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.name != "config.json" and not (scratch / f.name).exists():
            (scratch / f.name).symlink_to(f.resolve())
    (scratch / "config.json").write_text(json.dumps({**cfg, "rope_theta": params["rope_theta"]}, indent=2))
    print(f"rope_theta {params['rope_theta']} written at the top level of a copy of the config ({scratch}): "
          "transformers 4.51 reads only that spelling", file=sys.stderr, flush=True)
    return scratch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", type=Path)
    ap.add_argument("windows", type=Path, help="JSON [samples][seqlen] token ids")
    ap.add_argument("out", type=Path)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import awq
    import torch
    from awq import AutoAWQForCausalLM
    from transformers import PreTrainedTokenizerFast

    torch.set_num_threads(args.threads)
    fixed = fix_cpu_state_copy()
    print(f"autoawq {getattr(awq, '__version__', '?')}; CPU state-copy fix applied: {fixed}", flush=True)
    windows = json.loads(args.windows.read_text())
    args.source = legacy_rope_source(args.source, args.out.with_name(args.out.name + ".source"))
    model = AutoAWQForCausalLM.from_pretrained(str(args.source), torch_dtype=torch.float32, device_map="cpu")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(args.source / "tokenizer.json"))  # ids are given
    start = time.perf_counter()
    model.quantize(tokenizer, quant_config={"zero_point": True, "q_group_size": args.group_size, "w_bit": 4,
                                            "version": "GEMM"},
                   calib_data=windows, max_calib_samples=len(windows), max_calib_seq_len=len(windows[0]))
    seconds = time.perf_counter() - start
    model.save_quantized(str(args.out))
    for f in args.source.iterdir():  # the tokenizer as the source has it (transformers 4.51 would rewrite it)
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
            shutil.copy(f, args.out / f.name)
    print(json.dumps({"quantize_seconds": round(seconds, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
