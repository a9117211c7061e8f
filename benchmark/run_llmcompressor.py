"""llm-compressor (the peer of `lmkit lite smooth_quant` and `lmkit lite awq`) on given calibration windows, in the
interpreter that has it, written compressed (compressed-tensors):

    PYTHON_WITH_LLMCOMPRESSOR benchmark/run_llmcompressor.py SOURCE WINDOWS.json OUT [--smoothing-strength 0.8]
    PYTHON_WITH_LLMCOMPRESSOR benchmark/run_llmcompressor.py SOURCE WINDOWS.json OUT --recipe w4a16-gptq --group-size 64

Run by `benchmark/eval_smoothquant.py --llmcompressor-python PY` (w8a8) and `benchmark/eval_awq.py
--llmcompressor-python PY` (w4a16-gptq, w4a16-awq), which write WINDOWS.json (lmkit's own calibration windows, token
ids [samples][seqlen]) so that both tools see the same text, and then score OUT with lmkit's torch perplexity path
and its engine. llm-compressor pins its own transformers, so it lives in its own environment, e.g.:

    python -m venv /tmp/llmc
    /tmp/llmc/bin/pip install torch==2.13.0 && /tmp/llmc/bin/pip install llmcompressor==0.14.0.1 torch==2.13.0

Recipes: w8a8 = its W8A8 int8 example, SmoothQuantModifier(smoothing_strength=0.8) then GPTQModifier(targets=
"Linear", scheme="W8A8", ignore=["lm_head"]); w4a16-gptq = GPTQModifier (its defaults: static activation order),
w4a16-awq = AWQModifier's smoothing then QuantizationModifier (min-max round-to-nearest, no clip search), on int4
asymmetric weights in groups of --group-size (lmkit's int4 form; its W4A16_ASYM preset but for the group size),
lm_head left fp. Prints one JSON line: the quantize time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path)
    parser.add_argument("windows", type=Path, help="JSON: token ids [samples][seqlen]")
    parser.add_argument("out", type=Path)
    parser.add_argument("--smoothing-strength", type=float, default=0.8)
    parser.add_argument("--recipe", choices=("w8a8", "w4a16-gptq", "w4a16-awq"), default="w8a8")
    parser.add_argument("--group-size", type=int, default=128)
    args = parser.parse_args(argv)

    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.modifiers.smoothquant import SmoothQuantModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    windows = json.loads(args.windows.read_text())
    ds = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * len(w) for w in windows]})
    model = AutoModelForCausalLM.from_pretrained(str(args.source), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(args.source))
    if args.recipe == "w8a8":
        recipe = [SmoothQuantModifier(smoothing_strength=args.smoothing_strength),
                  GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])]
    else:
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from llmcompressor.modifiers.transform.awq import AWQModifier

        int4 = {"group_0": QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
            num_bits=4, type="int", symmetric=False, strategy="group", group_size=args.group_size))}
        if args.recipe == "w4a16-gptq":
            recipe = [GPTQModifier(config_groups=int4, ignore=["lm_head"])]
        else:  # AWQ's smoothing, then min-max round-to-nearest (its AWQ recipe: no clip search)
            recipe = [AWQModifier(), QuantizationModifier(config_groups=int4, ignore=["lm_head"])]
            if not torch.cuda.is_available():  # 0.14's AWQ pins its cached activations, which needs an accelerator:
                from llmcompressor.pipelines.cache import IntermediatesCache  # on a CPU-only machine they stay put

                IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    start = time.perf_counter()
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=len(windows[0]),
            num_calibration_samples=len(windows))
    seconds = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(args.out), save_compressed=True)
    tokenizer.save_pretrained(str(args.out))
    for extra in ("generation_config.json", "chat_template.jinja"):
        if (args.source / extra).is_file() and not (args.out / extra).exists():
            shutil.copy2(args.source / extra, args.out / extra)
    print(json.dumps({"quantize_seconds": round(seconds, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
