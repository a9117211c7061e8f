"""Task accuracy of checkpoints through lm-evaluation-harness, scored by lmkit's own engine (lite/harness.py):
the offline tasks of eval_tasks.py (built from held-out text into the cache) plus anything lm-eval can load.

    evaluate_tasks(model, EvalConfig)   -> TaskResult (per task and metric: value and standard error)
    compare_table(results)              -> rows for a side-by-side table (fp vs AWQ vs RTN)
    paired_table(results)               -> each model minus the first, per document (mean-aggregated metrics):
                                           the difference and its paired standard error, far tighter than the
                                           two scores' own errors when the models agree on most documents
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from lmkit.env import cache_dir
from lmkit.lite.config import EvalConfig
from lmkit.lite.eval_tasks import LOCAL_TASKS, TASKS_VERSION, write_local_tasks


@dataclass(frozen=True)
class TaskResult:
    """One checkpoint's scores: metrics[task][metric] = (value, standard error or None)."""

    model: str
    metrics: dict[str, dict[str, tuple[float, float | None]]]
    num_examples: dict[str, int]
    seconds: float
    per_doc: dict[str, dict[str, dict[int, float]]] = None
    """per_doc[task][metric][doc_id]: the document's value of a mean-aggregated metric (acc, acc_norm)."""

    def as_dict(self) -> dict:
        return {"model": self.model, "seconds": round(self.seconds, 2), "num_examples": self.num_examples,
                "metrics": {task: {m: {"value": v, "stderr": e} for m, (v, e) in ms.items()}
                            for task, ms in self.metrics.items()}}


def local_tasks_dir() -> Path:
    return write_local_tasks(cache_dir() / "eval_tasks" / f"v{TASKS_VERSION}")


def _number(x) -> float | None:
    try:
        value = float(x)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def evaluate_tasks(model: str | Path | None, config: EvalConfig) -> TaskResult:
    """Scores ``model`` (an HF or AWQ folder; None: the bundled SmolLM2) on config.tasks with lm-eval, through
    an lmkit engine of config's dtype and threads. Raises ValueError naming a task lm-eval does not know."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ImportError("task accuracy needs lm-evaluation-harness: pip install 'lmkit[eval]' "
                          "(or pip install 'lm_eval[api]==0.4.13')") from None

    from lmkit.lite.harness import LmkitLM

    include = [str(local_tasks_dir())] + [str(Path(p).expanduser()) for p in config.include_path]
    manager = TaskManager(include_path=include)
    unknown = [t for t in config.tasks if t not in manager.all_tasks]
    if unknown:
        local = ", ".join(LOCAL_TASKS)
        raise ValueError(f"unknown lm-eval task(s): {', '.join(unknown)} (offline tasks: {local}; others come from "
                         "lm-eval's registry or an --include-path folder)")
    start = time.perf_counter()
    lm = LmkitLM(pretrained=model, dtype=config.dtype, num_threads=config.num_threads,
                 max_batch_size=config.max_batch_size)
    try:
        out = lm_eval.simple_evaluate(model=lm, tasks=list(config.tasks), num_fewshot=config.num_fewshot,
                                      limit=config.limit, task_manager=manager, random_seed=config.seed,
                                      numpy_random_seed=config.seed, torch_random_seed=config.seed,
                                      fewshot_random_seed=config.seed, log_samples=True)
    finally:
        lm.close()
    metrics: dict[str, dict[str, tuple[float, float | None]]] = {}
    for task, values in out["results"].items():
        row: dict[str, tuple[float, float | None]] = {}
        for key, value in values.items():
            if "," not in key or "_stderr," in key:
                continue
            name, _, filt = key.partition(",")
            number = _number(value)
            if number is None:
                continue
            label = name if filt == "none" else f"{name} ({filt})"
            row[label] = (number, _number(values.get(f"{name}_stderr,{filt}")))
        metrics[task] = row
    counts = {task: int(n.get("effective", n.get("original", 0))) if isinstance(n, dict) else int(n)
              for task, n in out.get("n-samples", {}).items()}
    return TaskResult(str(model) if model is not None else "smollm2", metrics, counts, time.perf_counter() - start,
                      _per_doc(out.get("samples", {}), metrics))


def _per_doc(samples: dict, metrics: dict) -> dict[str, dict[str, dict[int, float]]]:
    """The per-document values of the metrics whose score is their mean (the others, perplexity, are not
    differences of documents)."""
    out: dict[str, dict[str, dict[int, float]]] = {}
    for task, docs in samples.items():
        for metric, (value, _) in metrics.get(task, {}).items():
            values = {s["doc_id"]: s.get(metric) for s in docs}
            if not values or not all(isinstance(v, (int, float)) for v in values.values()):
                continue
            if abs(sum(values.values()) / len(values) - value) <= 1e-9:
                out.setdefault(task, {})[metric] = {int(k): float(v) for k, v in values.items()}
    return out


def paired_difference(a: TaskResult, b: TaskResult, task: str, metric: str) -> tuple[float, float, int] | None:
    """(mean of b - a over the documents both scored, its standard error, documents) or None."""
    da = (a.per_doc or {}).get(task, {}).get(metric)
    db = (b.per_doc or {}).get(task, {}).get(metric)
    if not da or not db:
        return None
    diffs = [db[k] - da[k] for k in sorted(set(da) & set(db))]
    n = len(diffs)
    if n < 2:
        return None
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1)
    return mean, math.sqrt(var / n), n


def paired_table(results: list[TaskResult]) -> list[list[str]]:
    """Rows [task, metric, difference ± paired standard error of each later result minus the first]."""
    rows = []
    for task, ms in results[0].metrics.items():
        for metric in ms:
            cells = []
            for r in results[1:]:
                d = paired_difference(results[0], r, task, metric)
                cells.append("" if d is None else f"{d[0]:+.4f} ± {d[1]:.4f}")
            if any(cells):
                rows.append([task, metric, *cells])
    return rows


def compare_table(results: list[TaskResult]) -> list[list[str]]:
    """Rows [task, metric, value ± stderr per result] over the (task, metric) pairs of the first result."""
    rows = []
    for task, ms in results[0].metrics.items():
        for metric in ms:
            cells = []
            for r in results:
                value, err = r.metrics.get(task, {}).get(metric, (float("nan"), None))
                cells.append(f"{value:.4f}" + (f" ± {err:.4f}" if err is not None else ""))
            rows.append([task, metric, *cells])
    return rows
