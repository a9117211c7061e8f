"""``lmkit lite ...``: each command is a thin typer wrapper over one typed function
(``quantize_awq(model, AwqConfig)``, ``quantize_smooth_quant(model, SmoothQuantConfig)``,
``quantize_fp8(model, Fp8Config)``, ``quantize_fp4(model, Fp4Config)``, ``evaluate_perplexity(model, PplConfig)``,
``calibrate_kv(model, KvCalibConfig)``); rich renders progress on stderr and the summary on stdout."""

from __future__ import annotations

import time
from dataclasses import fields
from pathlib import Path
from typing import Optional

import typer

from lmkit.config import help_text
from lmkit.lite.config import AwqConfig, EvalConfig, Fp4Config, Fp8Config, KlConfig, KvCalibConfig, PplConfig, \
    SmoothQuantConfig
from lmkit.model_path import MODEL_HELP

# rich_markup_mode=None: click's plain help, whole option names at any width (see lmkit/cli/main.py)
app = typer.Typer(help="Compression: AWQ int4 weights, SmoothQuant W8A8 int8, FP8 E4M3 weights, a calibrated "
                       "int8/int4 KV cache policy, and perplexity to measure what they cost.",
                  no_args_is_help=True, add_completion=False, rich_markup_mode=None)

# --help gives the first sentences of the configs' HELP texts (help_text); the HELP texts are the contract
_A, _P, _K, _E, _S, _KL = ({name: help_text(doc) for name, doc in c.HELP.items()}
                           for c in (AwqConfig, PplConfig, KvCalibConfig, EvalConfig, SmoothQuantConfig, KlConfig))
_AD = {f.name: f.default for f in fields(AwqConfig)}  # the options' defaults are the config's
_SD = {f.name: f.default for f in fields(SmoothQuantConfig)}
_F = {name: help_text(doc) for name, doc in Fp8Config.HELP.items()}
_FD = {f.name: f.default for f in fields(Fp8Config)}
_F4 = {name: help_text(doc) for name, doc in Fp4Config.HELP.items()}
_F4D = {f.name: f.default for f in fields(Fp4Config)}


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


class ProgressReporter:
    """A status line per phase and progress bars (elapsed, ETA), on stderr; the commands' reporters add
    what they count."""

    def __init__(self, console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, \
            TimeElapsedColumn, TimeRemainingColumn

        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("elapsed"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                 console=console, transient=False)
        self.task = None
        self.status = None

    def __enter__(self):
        self.progress.start()
        self.status = self.progress.add_task("starting", total=None)
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def phase(self, description: str) -> None:
        self.progress.update(self.status, description=description)


class RichReporter(ProgressReporter):
    """Progress over decoder layers, for ``quantize_awq``."""

    def start_layers(self, num_layers: int) -> None:
        self.progress.update(self.status, description="quantizing", visible=False)
        self.task = self.progress.add_task("layers", total=num_layers)

    def layer_done(self, index: int, report: dict) -> None:
        smoothed = [g for g in report.get("groups", []) if g.get("smoothed")]  # AWQ's and SmoothQuant's reports
        done = f" ({len(smoothed)} groups smoothed)" if "groups" in report else ""  # lite fp8 smooths nothing
        self.progress.update(self.task, advance=1, description=f"layer {index}{done}")
        experts = report.get("experts")
        if experts and experts["searched_on_all_tokens"]:  # said, not silently handled
            tokens = experts["tokens_per_expert"]
            few = ", ".join(f"{e} ({tokens[e]})" for e in experts["searched_on_all_tokens"])
            self.progress.console.print(
                f"[yellow]layer {index}: experts reached by fewer than {experts['min_tokens']} calibration tokens "
                f"(tokens): {few}; their down_proj is searched on every token of the search windows instead "
                f"(report.json: layers[{index}].experts)[/yellow]")
        if index + 1 == self.progress.tasks[self.task].total:
            self.progress.update(self.status, visible=True)


@app.command()
def awq(
    model: Optional[str] = typer.Argument(None, metavar="MODEL", show_default=False, help=MODEL_HELP),
    work_dir: Path = typer.Option(..., "--work-dir", help=_A["work_dir"]),
    w_group_size: int = typer.Option(_AD["w_group_size"], help=_A["w_group_size"]),
    format: str = typer.Option(_AD["format"], "--format", help=_A["format"]),
    calib_dataset: str = typer.Option(_AD["calib_dataset"], help=_A["calib_dataset"]),
    calib_samples: int = typer.Option(_AD["calib_samples"], help=_A["calib_samples"]),
    calib_seqlen: int = typer.Option(_AD["calib_seqlen"], help=_A["calib_seqlen"]),
    seed: int = typer.Option(_AD["seed"], help=_A["seed"]),
    search_scale: bool = typer.Option(True, "--search-scale/--no-search-scale", help=_A["search_scale"]),
    clip: bool = typer.Option(True, "--clip/--no-clip", help=_A["clip"]),
    rtn: bool = typer.Option(False, "--rtn", help="Plain round-to-nearest baseline (same as --calib-samples 0)."),
    search_samples: int = typer.Option(_AD["search_samples"], help=_A["search_samples"]),
    num_grid: int = typer.Option(_AD["num_grid"], help=_A["num_grid"]),
    scale_form: str = typer.Option(_AD["scale_form"], help=_A["scale_form"]),
    propagate: str = typer.Option(_AD["propagate"], help=_A["propagate"]),
    rounding: str = typer.Option(_AD["rounding"], help=_A["rounding"]),
    gptq_order: str = typer.Option(_AD["gptq_order"], help=_A["gptq_order"]),
    gptq_model_target: float = typer.Option(_AD["gptq_model_target"], help=_A["gptq_model_target"]),
    calib_precision: str = typer.Option(_AD["calib_precision"], help=_A["calib_precision"]),
    refine: bool = typer.Option(False, "--refine/--no-refine", help=_A["refine"]),
    clip_qk: bool = typer.Option(False, "--clip-qk", help=_A["clip_qk"]),
    device: str = typer.Option(_AD["device"], help=_A["device"]),
    overwrite: bool = typer.Option(False, "--overwrite", help=_A["overwrite"]),
    eval: bool = typer.Option(False, "--eval", help=_A["eval"]),
    eval_dataset: str = typer.Option(_AD["eval_dataset"], help=_A["eval_dataset"]),
    eval_tasks: str = typer.Option("", help=_A["eval_tasks"]),
    eval_limit: Optional[int] = typer.Option(None, help=_A["eval_limit"]),
) -> None:
    """Quantize MODEL to 4-bit AWQ into --work-dir (AutoAWQ GEMM or compressed-tensors pack-quantized)."""
    from rich.console import Console

    from lmkit.lite.awq import quantize_awq

    config = AwqConfig(work_dir=work_dir, w_group_size=w_group_size, format=format, calib_dataset=calib_dataset,
                       calib_samples=0 if rtn else calib_samples, calib_seqlen=calib_seqlen, seed=seed,
                       search_scale=search_scale, clip=clip, search_samples=search_samples, num_grid=num_grid,
                       scale_form=scale_form, propagate=propagate, rounding=rounding, gptq_order=gptq_order,
                       gptq_model_target=gptq_model_target, calib_precision=calib_precision, refine=refine,
                       clip_qk=clip_qk, device=device,
                       overwrite=overwrite,
                       eval=eval, eval_dataset=eval_dataset, eval_tasks=_task_names(eval_tasks),
                       eval_limit=eval_limit)
    err = Console(stderr=True, highlight=False)
    with RichReporter(err) as reporter:
        result = quantize_awq(model, config, reporter)
    print_awq_summary(result, config)


@app.command()
def convert(
    model: str = typer.Argument(..., metavar="MODEL", show_default=False,
                                help="An int4 checkpoint folder (AutoAWQ GEMM or compressed-tensors pack-quantized)."),
    work_dir: Path = typer.Option(..., "--work-dir", help="Where the converted folder goes."),
    format: str = typer.Option(..., "--format", help="The target: autoawq or compressed-tensors."),
    overwrite: bool = typer.Option(False, "--overwrite", help=_A["overwrite"]),
) -> None:
    """Rewrite the int4 checkpoint MODEL in another format lmkit writes, losslessly (same q, zeros, scales)."""
    from rich.console import Console

    from lmkit.lite.convert import convert_checkpoint

    result = convert_checkpoint(model, work_dir, format, overwrite=overwrite)
    Console(highlight=False).print(
        f"{result.source_format} -> {result.checkpoint_format}: {result.num_linears} int4 linears (group size "
        f"{result.group_size}), {_mib(result.size_bytes)} -> {result.work_dir}")


def print_awq_summary(result, config: AwqConfig) -> None:
    """The closing table of ``lmkit lite awq``."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{result.method.upper()} int4 -> {result.work_dir}", show_header=False, title_justify="left")
    table.add_row("source", str(result.source))
    table.add_row("layers", str(result.num_layers))
    table.add_row("group size", str(result.group_size))
    if result.method == "awq":
        table.add_row("calibration", f"{config.calib_samples} x {config.calib_seqlen} tokens of {config.calib_dataset}"
                                     f" (seed {config.seed}); scale search {'on' if config.search_scale else 'off'}, "
                                     f"clip {'on' if config.clip else 'off'}")
    _add_result_rows(table, result)
    Console(highlight=False).print(table)


def _add_result_rows(table, result) -> None:
    """Time, size, and the perplexity and task rows of a quantizer's summary table."""
    table.add_row("time", f"{result.seconds:.1f} s")
    table.add_row("size", f"{_mib(result.size_before_bytes)} -> {_mib(result.size_after_bytes)} "
                          f"({result.size_before_bytes / max(result.size_after_bytes, 1):.2f}x smaller)")
    if result.ppl_before is not None:
        before, after = result.ppl_before, result.ppl_after
        table.add_row("perplexity", f"{before.ppl:.3f} -> {after.ppl:.3f} ({after.ppl / before.ppl - 1:+.1%}) on "
                                    f"{before.num_tokens} tokens of {before.dataset}")
    from lmkit.lite.progress import KlFailure

    kl = result.kl
    if isinstance(kl, KlFailure):
        table.add_row("KL from the source", f"not measured: {kl.error}")
    elif kl is not None:
        table.add_row("KL from the source", f"mean {kl.mean_kl:.5f} ± {kl.mean_kl_stderr:.5f} (p99 {kl.p99_kl:.4f}), "
                                            f"same top token {100 * kl.same_top1:.2f}% on {kl.positions} positions")
    if result.tasks_before is not None:
        from lmkit.lite.evaluate import compare_table

        from lmkit.lite.evaluate import paired_difference

        for task, metric, before, after in compare_table([result.tasks_before, result.tasks_after]):
            d = paired_difference(result.tasks_before, result.tasks_after, task, metric)
            paired = f" (paired difference {d[0]:+.4f} ± {d[1]:.4f})" if d else ""
            table.add_row(f"{task} {metric}", f"{before} -> {after}{paired}")


@app.command("smooth_quant")
def smooth_quant(
    model: Optional[str] = typer.Argument(None, metavar="MODEL", show_default=False, help=MODEL_HELP),
    work_dir: Path = typer.Option(..., "--work-dir", help=_S["work_dir"]),
    smooth: bool = typer.Option(True, "--smooth/--no-smooth", help=_S["smooth"]),
    alpha: Optional[float] = typer.Option(None, help=_S["alpha"]),
    num_grid: int = typer.Option(_SD["num_grid"], help=_S["num_grid"]),
    calib_dataset: str = typer.Option(_SD["calib_dataset"], help=_S["calib_dataset"]),
    calib_samples: int = typer.Option(_SD["calib_samples"], help=_S["calib_samples"]),
    calib_seqlen: int = typer.Option(_SD["calib_seqlen"], help=_S["calib_seqlen"]),
    seed: int = typer.Option(_SD["seed"], help=_S["seed"]),
    search_samples: int = typer.Option(_SD["search_samples"], help=_S["search_samples"]),
    rounding: str = typer.Option(_SD["rounding"], help=_S["rounding"]),
    propagate: str = typer.Option(_SD["propagate"], help=_S["propagate"]),
    device: str = typer.Option(_SD["device"], help=_S["device"]),
    overwrite: bool = typer.Option(False, "--overwrite", help=_S["overwrite"]),
    eval: bool = typer.Option(False, "--eval", help=_S["eval"]),
    eval_dataset: str = typer.Option(_SD["eval_dataset"], help=_S["eval_dataset"]),
    eval_tasks: str = typer.Option("", help=_S["eval_tasks"]),
    eval_limit: Optional[int] = typer.Option(None, help=_S["eval_limit"]),
) -> None:
    """Quantize MODEL to SmoothQuant W8A8 int8 into --work-dir (compressed-tensors int-quantized: int8 weights per
    channel, int8 activations per token)."""
    from rich.console import Console
    from rich.table import Table

    from lmkit.lite.smoothquant import quantize_smooth_quant

    config = SmoothQuantConfig(work_dir=work_dir, smooth=smooth, alpha=alpha, num_grid=num_grid, calib_dataset=calib_dataset,
                               calib_samples=calib_samples, calib_seqlen=calib_seqlen, seed=seed,
                               search_samples=search_samples, rounding=rounding, propagate=propagate, device=device,
                               overwrite=overwrite, eval=eval, eval_dataset=eval_dataset,
                               eval_tasks=_task_names(eval_tasks), eval_limit=eval_limit)
    with RichReporter(Console(stderr=True, highlight=False)) as reporter:
        result = quantize_smooth_quant(model, config, reporter)
    table = Table(title=f"SmoothQuant W8A8 int8 -> {result.work_dir}", show_header=False, title_justify="left")
    table.add_row("source", str(result.source))
    table.add_row("layers", str(result.num_layers))
    alphas = [g["alpha"] for layer in result.layers for g in layer["groups"] if g.get("smoothed")]
    groups = sum(len(layer["groups"]) for layer in result.layers)
    table.add_row("smoothing", f"{len(alphas)} of {groups} groups smoothed, alpha "
                               + (f"{min(alphas):.2f}..{max(alphas):.2f} (median "
                                  f"{sorted(alphas)[len(alphas) // 2]:.2f})" if alphas else "-")
                               + ("" if not config.smooth else " (given)" if config.alpha is not None else " (searched)"))
    table.add_row("calibration", f"{config.calib_samples} x {config.calib_seqlen} tokens of {config.calib_dataset} "
                                 f"(seed {config.seed}); {config.rounding} rounding")
    _add_result_rows(table, result)
    Console(highlight=False).print(table)


@app.command("fp8")
def fp8(
    model: Optional[str] = typer.Argument(None, metavar="MODEL", show_default=False, help=MODEL_HELP),
    work_dir: Path = typer.Option(..., "--work-dir", help=_F["work_dir"]),
    scheme: str = typer.Option(_FD["scheme"], help=_F["scheme"]),
    device: str = typer.Option(_FD["device"], help=_F["device"]),
    overwrite: bool = typer.Option(False, "--overwrite", help=_F["overwrite"]),
) -> None:
    """Quantize MODEL to FP8 E4M3 weights into --work-dir (compressed-tensors, llm-compressor's FP8_DYNAMIC or FP8
    weight-only; round to nearest, no calibration)."""
    from rich.console import Console
    from rich.table import Table

    from lmkit.lite.fp8 import quantize_fp8

    config = Fp8Config(work_dir=work_dir, scheme=scheme, device=device, overwrite=overwrite)
    with RichReporter(Console(stderr=True, highlight=False)) as reporter:
        result = quantize_fp8(model, config, reporter)
    table = Table(title=f"FP8 E4M3 ({result.scheme}) -> {result.work_dir}", show_header=False, title_justify="left")
    table.add_row("source", str(result.source))
    table.add_row("format", f"compressed-tensors {result.format}: {result.num_linears} linears in "
                            f"{result.num_layers} layers, scales per output channel")
    table.add_row("time", f"{result.seconds:.1f} s")
    table.add_row("size", f"{_mib(result.size_before_bytes)} -> {_mib(result.size_after_bytes)} "
                          f"({result.size_before_bytes / max(result.size_after_bytes, 1):.2f}x smaller)")
    Console(highlight=False).print(table)


@app.command("fp4")
def fp4(
    model: Optional[str] = typer.Argument(None, metavar="MODEL", show_default=False, help=MODEL_HELP),
    work_dir: Path = typer.Option(..., "--work-dir", help=_F4["work_dir"]),
    format: str = typer.Option(_F4D["format"], "--format", help=_F4["format"]),
    device: str = typer.Option(_F4D["device"], help=_F4["device"]),
    overwrite: bool = typer.Option(False, "--overwrite", help=_F4["overwrite"]),
) -> None:
    """Quantize MODEL to FP4 weights into --work-dir (compressed-tensors, llm-compressor's NVFP4A16 or MXFP4A16;
    round to nearest, no calibration)."""
    from rich.console import Console
    from rich.table import Table

    from lmkit.lite.fp4 import quantize_fp4

    config = Fp4Config(work_dir=work_dir, format=format, device=device, overwrite=overwrite)
    with RichReporter(Console(stderr=True, highlight=False)) as reporter:
        result = quantize_fp4(model, config, reporter)
    scales = "an E4M3 scale per 16 inputs, a global scale per linear" if result.scheme == "nvfp4" else \
        "an e8m0 scale per 32 inputs"
    table = Table(title=f"FP4 {result.scheme} -> {result.work_dir}", show_header=False, title_justify="left")
    table.add_row("source", str(result.source))
    table.add_row("format", f"compressed-tensors {result.format}: {result.num_linears} linears in "
                            f"{result.num_layers} layers, {scales}")
    table.add_row("time", f"{result.seconds:.1f} s")
    table.add_row("size", f"{_mib(result.size_before_bytes)} -> {_mib(result.size_after_bytes)} "
                          f"({result.size_before_bytes / max(result.size_after_bytes, 1):.2f}x smaller)")
    Console(highlight=False).print(table)


def _task_names(tasks: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in tasks.split(",") if t.strip())


@app.command()
def ppl(
    model: Optional[str] = typer.Argument(None, metavar="MODEL", show_default=False,
                                          help=MODEL_HELP + " Read by lmkit's torch reference path."),
    dataset: str = typer.Option("hamlet", help=_P["dataset"]),
    seqlen: int = typer.Option(512, help=_P["seqlen"]),
    stride: int = typer.Option(0, help=_P["stride"]),
    max_tokens: int = typer.Option(2048, help=_P["max_tokens"]),
    device: str = typer.Option("auto", help=_P["device"]),
    batch_size: int = typer.Option(4, help=_P["batch_size"]),
) -> None:
    """Perplexity of MODEL on fixed held-out text, with sliding windows."""
    from rich.console import Console

    from lmkit.lite.ppl import evaluate_perplexity

    config = PplConfig(dataset=dataset, seqlen=seqlen, stride=stride, max_tokens=max_tokens, device=device,
                       batch_size=batch_size)
    err = Console(stderr=True, highlight=False)
    start = time.perf_counter()
    with err.status(f"perplexity on {dataset}"):
        result = evaluate_perplexity(model, config)
    Console(highlight=False).print(
        f"perplexity {result.ppl:.4f}  ({result.kind}, {result.num_tokens} tokens evaluated in "
        f"{result.num_windows} windows of {result.seqlen}, stride {result.stride}, dataset {result.dataset}; "
        f"{time.perf_counter() - start:.1f} s)")


@app.command("eval")
def eval_(
    models: Optional[list[str]] = typer.Argument(None, metavar="MODEL...", show_default=False,
                                                 help=MODEL_HELP + " Several: scored side by side."),
    tasks: Optional[str] = typer.Option(None, help=_E["tasks"], show_default=False),
    limit: Optional[int] = typer.Option(None, help=_E["limit"]),
    num_fewshot: Optional[int] = typer.Option(None, help=_E["num_fewshot"]),
    include_path: Optional[list[str]] = typer.Option(None, help=_E["include_path"]),
    dtype: str = typer.Option(EvalConfig.dtype, help=_E["dtype"]),
    num_threads: Optional[int] = typer.Option(None, help=_E["num_threads"]),
    max_batch_size: int = typer.Option(EvalConfig.max_batch_size, help=_E["max_batch_size"]),
    seed: int = typer.Option(EvalConfig.seed, help=_E["seed"]),
    kl: bool = typer.Option(False, "--kl", help=_KL["kl"]),
    kl_dataset: str = typer.Option(KlConfig.dataset, help=_KL["dataset"]),
    kl_seqlen: int = typer.Option(KlConfig.seqlen, help=_KL["seqlen"]),
    kl_max_tokens: int = typer.Option(KlConfig.max_tokens, help=_KL["max_tokens"]),
    output: Optional[Path] = typer.Option(None, help="Also write the scores as JSON to this file."),
) -> None:
    """Task accuracy of MODEL(s) through lm-evaluation-harness, scored by lmkit's engine (fp vs AWQ vs RTN), and
    with --kl the KL divergence of each from the first."""
    import json

    from rich.console import Console

    models = models or [None]
    if kl and len(models) < 2:
        raise typer.BadParameter("--kl compares models with the first: name at least two MODELs")
    kl_config = KlConfig(dataset=kl_dataset, seqlen=kl_seqlen, max_tokens=kl_max_tokens, dtype=dtype,
                         num_threads=num_threads) if kl else None
    config = None
    if tasks is not None or not kl:
        config = EvalConfig(tasks=_task_names(tasks) if tasks is not None else EvalConfig.tasks, limit=limit,
                            num_fewshot=num_fewshot, include_path=tuple(include_path or ()), dtype=dtype,
                            num_threads=num_threads, max_batch_size=max_batch_size, seed=seed)
    out = Console(highlight=False)
    err = Console(stderr=True, highlight=False)
    report: dict = {}
    if config is not None:
        report.update(_eval_tasks(models, config, out, err))
    if kl_config is not None:
        report["kl"] = _eval_kl(models, kl_config, out, err)
    if output is not None:
        output.write_text(json.dumps(report, indent=2))


def _eval_tasks(models: list, config: EvalConfig, out, err) -> dict:
    """lm-eval's scores of each model, side by side and paired against the first; the JSON report's part."""
    from rich.table import Table

    from lmkit.lite.evaluate import compare_table, evaluate_tasks, paired_table

    results = []
    for model in models:
        with err.status(f"lm-eval {', '.join(config.tasks)} on {model or 'smollm2'}"):
            results.append(evaluate_tasks(model, config))
    table = Table(title=f"lm-eval through lmkit's engine ({config.dtype})", title_justify="left")
    for column in ["task", "metric", *[r.model for r in results]]:
        table.add_column(column)
    for row in compare_table(results):
        table.add_row(*row)
    out.print(table)
    paired = paired_table(results) if len(results) > 1 else []
    if paired:
        table = Table(title=f"minus {results[0].model}, per document (paired standard error)", title_justify="left")
        for column in ["task", "metric", *[r.model for r in results[1:]]]:
            table.add_column(column)
        for row in paired:
            table.add_row(*row)
        out.print(table)
    return {"settings": {**config.__dict__}, "results": [r.as_dict() for r in results], "paired_vs_first": paired}


def _eval_kl(models: list, config: KlConfig, out, err) -> list[dict]:
    """The KL divergence of each later model from the first, as a table; the JSON report's part."""
    from rich.table import Table

    from lmkit.lite.kl import kl_divergence

    results = []
    for model in models[1:]:
        with err.status(f"KL divergence of {model} from {models[0] or 'smollm2'} on {config.dataset}"):
            results.append(kl_divergence(models[0], model, config))
    first = results[0]
    table = Table(title=f"KL divergence from {first.reference} ({first.positions} positions of {config.dataset}, "
                        f"windows of {config.seqlen}, lmkit's engine in {config.dtype})", title_justify="left")
    for column in ["model", "mean KL", "median", "p99", "max", "same top token", "ppl", "ppl of the first"]:
        table.add_column(column)
    for r in results:
        table.add_row(r.model, f"{r.mean_kl:.5f} ± {r.mean_kl_stderr:.5f}", f"{r.median_kl:.5f}", f"{r.p99_kl:.4f}",
                      f"{r.max_kl:.4f}", f"{100 * r.same_top1:.2f}%", f"{r.ppl_model:.4f}", f"{r.ppl_reference:.4f}")
    out.print(table)
    return [r.as_dict() for r in results]


class StepReporter(ProgressReporter):
    """Progress over steps, for ``calibrate_kv``; the phase line shows again between step runs."""

    def phase(self, description: str) -> None:
        self.progress.update(self.status, description=description, visible=True)

    def start_steps(self, description: str, total: int) -> None:
        self.progress.update(self.status, visible=False)
        self.task = self.progress.add_task(description, total=total)

    def step_done(self) -> None:
        self.progress.advance(self.task)


@app.command()
def calibrate(
    model: Optional[str] = typer.Argument(None, metavar="MODEL", show_default=False, help=MODEL_HELP),
    work_dir: Path = typer.Option(..., "--work-dir", help=_K["work_dir"]),
    max_ppl_increase: float = typer.Option(0.01, help=_K["max_ppl_increase"]),
    calib_dataset: str = typer.Option("shakespeare", help=_K["calib_dataset"]),
    calib_samples: int = typer.Option(16, help=_K["calib_samples"]),
    calib_seqlen: int = typer.Option(512, help=_K["calib_seqlen"]),
    sensitivity_samples: int = typer.Option(4, help=_K["sensitivity_samples"]),
    seed: int = typer.Option(0, help=_K["seed"]),
    eval_dataset: str = typer.Option("hamlet", help=_K["eval_dataset"]),
    eval_seqlen: int = typer.Option(512, help=_K["eval_seqlen"]),
    eval_max_tokens: int = typer.Option(2048, help=_K["eval_max_tokens"]),
    batch_size: int = typer.Option(4, help=_K["batch_size"]),
    device: str = typer.Option("auto", help=_K["device"]),
    overwrite: bool = typer.Option(False, "--overwrite", help=_K["overwrite"]),
) -> None:
    """Choose the KV cache precision per layer (int4 where safe, else int8 or fp) of MODEL within a perplexity
    budget; write --work-dir/kv_policy.json for the engine (EngineConfig(kv_policy=PATH))."""
    from rich.console import Console

    from lmkit.lite.kvcalib import calibrate_kv

    config = KvCalibConfig(work_dir=work_dir, max_ppl_increase=max_ppl_increase, calib_dataset=calib_dataset,
                           calib_samples=calib_samples, calib_seqlen=calib_seqlen,
                           sensitivity_samples=sensitivity_samples, seed=seed, eval_dataset=eval_dataset,
                           eval_seqlen=eval_seqlen, eval_max_tokens=eval_max_tokens,
                           batch_size=batch_size, device=device, overwrite=overwrite)
    with StepReporter(Console(stderr=True, highlight=False)) as reporter:
        result = calibrate_kv(model, config, reporter)
    print_calibrate_summary(result, config)


def print_calibrate_summary(result, config: KvCalibConfig) -> None:
    """The closing tables of ``lmkit lite calibrate``: per layer, then the totals."""
    from rich.console import Console
    from rich.table import Table

    names = {0: "fp", 8: "int8", 4: "int4"}
    per_layer = Table(title="Per layer, only that layer quantized: relative error of the attention output "
                            "(int8; int4; int4 on K only; on V only), and KL divergence of the model's output "
                            "from fp (int4, nats per token)", title_justify="left")
    kl = result.layer_int4_kl
    columns = ["layer", "int8", "int4", "int4 K", "int4 V"] + (["int4 KL"] if kl else []) + ["policy"]
    for column in columns:
        per_layer.add_column(column, justify="right")
    for i, (errs, bits) in enumerate(zip(result.layer_errors, result.layers)):
        cells = [str(i)] + [f"{errs[k]:.4f}" for k in ("int8", "int4", "int4_k", "int4_v")]
        cells += [f"{kl[i]:.5f}"] if kl else []
        per_layer.add_row(*cells, names[bits])

    fp = result.ppl["fp"]
    summary = Table(title=f"KV policy -> {result.policy_path}", show_header=False, title_justify="left")
    summary.add_row("source", str(result.source))
    summary.add_row("layers", f"{result.num_layers}: {result.count(4)} int4, {result.count(8)} int8, "
                              f"{result.count(0)} fp")
    summary.add_row("policy", " ".join(str(b) for b in result.layers))
    dropped = f"; {result.num_calib_docs_dropped} documents sharing text with the evaluation text dropped" \
        if result.num_calib_docs_dropped else ""
    ranked = f"; layers ranked for int4 by KL on {config.sensitivity_samples} of them" if kl else \
        "; layers ranked for int4 by attention error"
    summary.add_row("calibration", f"{config.calib_samples} x {config.calib_seqlen} tokens of {config.calib_dataset} "
                                   f"(seed {config.seed}){ranked}{dropped}")
    summary.add_row("evaluation", f"{result.num_eval_tokens} tokens of {config.eval_dataset} in windows of "
                                  f"{config.eval_seqlen}")
    for key, label in (("fp", "perplexity fp KV"), ("int8", "perplexity all int8"), ("int4", "perplexity all int4"),
                       ("policy", "perplexity policy")):
        summary.add_row(label, f"{result.ppl[key]:.4f} ({result.ppl[key] / fp - 1:+.2%})")
    summary.add_row("budget", f"+{config.max_ppl_increase:.2%} (perplexity <= {result.ppl_limit:.4f}); "
                              f"{len(result.search)} perplexity evaluations")
    summary.add_row("time", f"{result.seconds:.1f} s")
    console = Console(highlight=False)
    console.print(per_layer)
    console.print(summary)
