"""What the layer-by-layer quantizers (``quantize_awq``, ``quantize_smooth_quant``) tell their caller as they go
(the CLI renders it with rich), the before/after quality they measure on request, and their report.json."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Reporter(Protocol):
    """Progress callbacks of a layer-by-layer quantizer."""

    def phase(self, description: str) -> None: ...

    def start_layers(self, num_layers: int) -> None: ...

    def layer_done(self, index: int, report: dict) -> None: ...


class SilentReporter:
    """A Reporter that says nothing (the default of the Python API)."""

    def phase(self, description: str) -> None:
        pass

    def start_layers(self, num_layers: int) -> None:
        pass

    def layer_done(self, index: int, report: dict) -> None:
        pass


def ppl_dict(result) -> dict | None:
    """report.json's entry of a PplResult (None: not measured)."""
    if result is None:
        return None
    return {"dataset": result.dataset, "ppl": result.ppl, "num_tokens": result.num_tokens}


def evaluate_before_after(result, config, source: Path, checkpoint: Path, label: str, reporter: Reporter) -> None:
    """Sets ``result``'s ppl_before/ppl_after and kl (``config.eval``: the checkpoint's next-token distributions
    against the source's, llama.cpp's --kl-divergence measure, on the same text and windows) and
    tasks_before/tasks_after (``config.eval_tasks``): the source against the finished ``checkpoint`` (called
    ``label`` in the progress line). ``config`` has the eval_* fields and device of AwqConfig / SmoothQuantConfig."""
    if config.eval:
        from lmkit.lite.config import KlConfig, PplConfig
        from lmkit.lite.kl import kl_divergence
        from lmkit.lite.ppl import evaluate_perplexity

        ppl_config = PplConfig(dataset=config.eval_dataset, seqlen=config.eval_seqlen,
                               max_tokens=config.eval_max_tokens, device=config.device)
        reporter.phase(f"perplexity of the source on {config.eval_dataset}")
        result.ppl_before = evaluate_perplexity(source, ppl_config)
        reporter.phase(f"perplexity of the {label} checkpoint on {config.eval_dataset}")
        result.ppl_after = evaluate_perplexity(checkpoint, ppl_config)
        reporter.phase(f"KL divergence of the {label} checkpoint from the source on {config.eval_dataset}")
        try:  # (lmkit's CPU engine runs both; a model it refuses loses the measure, never the checkpoint)
            result.kl = kl_divergence(source, checkpoint, KlConfig(dataset=config.eval_dataset,
                                                                   seqlen=config.eval_seqlen,
                                                                   max_tokens=config.eval_max_tokens))
        except (ValueError, RuntimeError, MemoryError) as e:
            result.kl = KlFailure(f"{type(e).__name__}: {e}")
            reporter.phase(f"KL divergence not measured: {result.kl.error}")
    if config.eval_tasks:
        from lmkit.lite.config import EvalConfig
        from lmkit.lite.evaluate import evaluate_tasks

        eval_config = EvalConfig(tasks=tuple(config.eval_tasks), limit=config.eval_limit)
        reporter.phase(f"tasks {', '.join(config.eval_tasks)}: the source")
        result.tasks_before = evaluate_tasks(source, eval_config)
        reporter.phase(f"tasks {', '.join(config.eval_tasks)}: the {label} checkpoint")
        result.tasks_after = evaluate_tasks(checkpoint, eval_config)


class KlFailure:
    """What stopped --eval's KL measure (the checkpoint is written all the same)."""

    def __init__(self, error: str):
        self.error = error

    def as_dict(self) -> dict:
        return {"error": self.error}


def report_json(result, config, calib_seqlen: int) -> dict:
    """report.json of a quantizer's run: settings, timings, sizes, before/after quality, per-layer reports."""
    return {
        "source": str(result.source), "method": result.method, "settings": config.as_dict(),
        "calib_seqlen_used": calib_seqlen, "seconds": round(result.seconds, 2),
        "phase_seconds": {k: round(v, 2) for k, v in result.phase_seconds.items()},
        "size_before_bytes": result.size_before_bytes, "size_after_bytes": result.size_after_bytes,
        "ppl_before": ppl_dict(result.ppl_before), "ppl_after": ppl_dict(result.ppl_after),
        # (measured on the checkpoint before it moved to work_dir)
        "kl": None if result.kl is None else result.kl.as_dict() if isinstance(result.kl, KlFailure)
        else dict(result.kl.as_dict(), model=str(result.work_dir)),
        "tasks_before": result.tasks_before.as_dict() if result.tasks_before else None,
        "tasks_after": result.tasks_after.as_dict() if result.tasks_after else None,
        "task_differences": task_differences(result.tasks_before, result.tasks_after),
        "layers": result.layers,
    }


def task_differences(before, after) -> list[dict] | None:
    """report.json's paired differences of two TaskResults (after - before per task and metric, over the documents
    both scored: the difference, its standard error and the documents), or None without tasks."""
    if before is None or after is None:
        return None
    from lmkit.lite.evaluate import paired_difference

    rows = []
    for task, metrics in before.metrics.items():
        for metric in metrics:
            d = paired_difference(before, after, task, metric)
            rows.append({"task": task, "metric": metric, "before": metrics[metric][0],
                         "after": after.metrics.get(task, {}).get(metric, (None,))[0],
                         "difference": d[0] if d else None, "stderr": d[1] if d else None,
                         "documents": d[2] if d else 0})
    return rows
