"""lm-evaluation-harness through lmkit, held to lm-eval's own ``hf`` model on the same HF folder (fp32, CPU):

- lmkit's registered lm-eval model (``lmkit lite eval``): loglikelihoods, greedy flags and accuracies of a
  multiple-choice and a next-word task, and the texts of a generate_until task;
- lm-eval's ``local-completions`` model pointed at a real api_server on loopback (echo + logprobs, max_tokens 1,
  token-id prompts: how lm-eval evaluates any OpenAI-compatible server), the same;
- the offline tasks are built from held-out text only, and ``lmkit lite eval`` prints the side-by-side table.
"""

from __future__ import annotations

import json
import math

import pytest

lm_eval = pytest.importorskip("lm_eval")

LIMIT = 12
GEN_TASK = """task: tiny_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: context
doc_to_target: target
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1
"""
TASKS = ["lmkit_hamlet_nextline", "lmkit_pydoc_nextword", "tiny_generate"]


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory):
    from lm_eval.tasks import TaskManager

    from lmkit.lite.eval_tasks import pydoc_nextword, write_local_tasks

    folder = write_local_tasks(tmp_path_factory.mktemp("tasks"), ["lmkit_hamlet_nextline", "lmkit_pydoc_nextword"])
    data = folder / "tiny_generate.jsonl"
    data.write_text("".join(json.dumps(e) + "\n" for e in pydoc_nextword()[:LIMIT]))
    (folder / "tiny_generate.yaml").write_text(GEN_TASK.format(data=json.dumps(str(data))))
    return TaskManager(include_path=str(folder))


def run(lm, manager) -> dict:
    return lm_eval.simple_evaluate(model=lm, tasks=TASKS, limit=LIMIT, task_manager=manager, log_samples=True,
                                   random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


@pytest.fixture(scope="module")
def hf_results(lite_tiny_llama, task_manager):
    from lm_eval.models.huggingface import HFLM

    return run(HFLM(pretrained=str(lite_tiny_llama), dtype="float32", device="cpu", batch_size=8), task_manager)


def assert_same(got: dict, want: dict) -> None:
    """Per sample: loglikelihoods within float tolerance (sums over a continuation's tokens), greedy flags and
    generated texts equal; the tasks' metrics equal."""
    for task in TASKS:
        g = sorted(got["samples"][task], key=lambda s: s["doc_id"])
        w = sorted(want["samples"][task], key=lambda s: s["doc_id"])
        assert len(g) == len(w) == LIMIT, task
        for a, b in zip(g, w):
            for ra, rb in zip(a["resps"], b["resps"]):
                if isinstance(rb[0], str):
                    assert ra[0] == rb[0], (task, a["doc_id"])
                else:
                    (lp_a, greedy_a), (lp_b, greedy_b) = ra[0], rb[0]
                    assert abs(lp_a - lp_b) <= 1e-3 * max(1.0, abs(lp_b)), (task, a["doc_id"], lp_a, lp_b)
                    assert greedy_a == greedy_b, (task, a["doc_id"])
        for metric, value in want["results"][task].items():
            if "," in metric and "_stderr" not in metric and isinstance(value, float) and math.isfinite(value):
                assert got["results"][task][metric] == pytest.approx(value, rel=1e-4), (task, metric)


@pytest.mark.slow
def test_lmkit_model_matches_hf(lite_tiny_llama, task_manager, hf_results):
    from lmkit.lite.harness import LmkitLM

    lm = LmkitLM(pretrained=str(lite_tiny_llama), dtype="float32", num_threads=2, max_batch_size=8)
    try:
        assert_same(run(lm, task_manager), hf_results)
    finally:
        lm.close()


@pytest.mark.slow
def test_local_completions_against_the_server(lite_tiny_llama, task_manager, hf_results):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from lmkit import AsyncEngine, EngineConfig
    from lmkit.serve import ServerConfig, create_app
    from tests.helpers import assert_blocks_free
    from tests.serve.harness import ServerThread

    engine = AsyncEngine(lite_tiny_llama, EngineConfig(device="cpu", dtype="float32", num_threads=2,
                                                       max_batch_size=16, cache_block_seq_len=16))
    server = ServerThread(create_app(engine, ServerConfig(model_name="tiny")))
    try:
        lm = LocalCompletionsAPI(base_url=f"{server.url}/v1/completions", model="tiny",
                                 tokenizer=str(lite_tiny_llama), tokenizer_backend="huggingface",
                                 tokenized_requests=True, batch_size=4, num_concurrent=2, max_retries=1,
                                 max_length=1000)
        assert_same(run(lm, task_manager), hf_results)
        assert_blocks_free(engine.engine)
    finally:
        server.stop()
        engine.close()


def test_offline_tasks_never_read_calibration_text():
    from lmkit.lite.corpora import pydoc_calibration, shakespeare_calibration
    from lmkit.lite.eval_tasks import hamlet_nextline, hamlet_nextword, pydoc_nextword

    calibration = "\n".join(shakespeare_calibration() + pydoc_calibration())
    for build in (hamlet_nextline, hamlet_nextword, pydoc_nextword):
        examples = build()
        assert len(examples) >= 200, build.__name__
        long_contexts = [e["context"] for e in examples if len(e["context"]) >= 80][:50]
        assert long_contexts and not any(c in calibration for c in long_contexts), build.__name__
    first = hamlet_nextline()
    assert first == hamlet_nextline() and all(0 <= e["gold"] < 4 and len(e["choices"]) == 4 for e in first)


@pytest.mark.slow
def test_cli_prints_the_side_by_side_table(lite_tiny_llama, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from lmkit.cli.main import app

    monkeypatch.setenv("LMKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "200")  # one line per table row
    out = tmp_path / "scores.json"
    result = CliRunner().invoke(app, ["lite", "eval", str(lite_tiny_llama), str(lite_tiny_llama), "--tasks",
                                      "lmkit_pydoc_nextword", "--limit", "8", "--num-threads", "2", "--output",
                                      str(out)])
    assert result.exit_code == 0, result.output
    assert "lmkit_pydoc_nextword" in result.output and "acc" in result.output
    report = json.loads(out.read_text())
    scores = report["results"]
    assert len(scores) == 2 and scores[0]["metrics"] == scores[1]["metrics"]  # the same model twice
    assert report["paired_vs_first"] == [["lmkit_pydoc_nextword", "acc", "+0.0000 ± 0.0000"]]
    assert "+0.0000 ± 0.0000" in result.output  # the paired table
    bad = CliRunner().invoke(app, ["lite", "eval", str(lite_tiny_llama), "--tasks", "no_such_task"])
    assert bad.exit_code != 0 and "unknown lm-eval task(s): no_such_task" in str(bad.exception)


def test_paired_difference_is_per_document():
    from lmkit.lite.evaluate import TaskResult, paired_difference

    a = TaskResult("a", {"t": {"acc": (0.5, 0.2)}}, {"t": 4}, 0.0, {"t": {"acc": {0: 1.0, 1: 0.0, 2: 1.0, 3: 0.0}}})
    b = TaskResult("b", {"t": {"acc": (0.75, 0.2)}}, {"t": 4}, 0.0, {"t": {"acc": {0: 1.0, 1: 1.0, 2: 1.0, 3: 0.0}}})
    mean, se, n = paired_difference(a, b, "t", "acc")
    assert (mean, n) == (0.25, 4) and se == pytest.approx(0.25)  # diffs 0, 1, 0, 0: sd 0.5, / sqrt(4)
    assert paired_difference(a, b, "t", "acc_norm") is None


@pytest.mark.slow
def test_awq_eval_tasks_go_into_the_report(lite_tiny_llama, tmp_path, monkeypatch):
    """lite awq --eval-tasks: the source and the checkpoint scored through the engine, in the summary table and
    awq/report.json beside the perplexity."""
    from typer.testing import CliRunner

    from lmkit.cli.main import app

    monkeypatch.setenv("LMKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "200")
    out = tmp_path / "rtn"
    result = CliRunner().invoke(app, ["lite", "awq", str(lite_tiny_llama), "--work-dir", str(out), "--rtn",
                                      "--w-group-size", "32", "--eval-tasks", "lmkit_pydoc_nextword",
                                      "--eval-limit", "8"])
    assert result.exit_code == 0, result.output
    assert "lmkit_pydoc_nextword acc" in result.output and "paired difference" in result.output
    report = json.loads((out / "awq" / "report.json").read_text())
    before, after = report["tasks_before"], report["tasks_after"]
    assert before["num_examples"] == after["num_examples"] == {"lmkit_pydoc_nextword": 8}
    assert set(before["metrics"]["lmkit_pydoc_nextword"]) == {"acc", "perplexity"}
    # the quantized model scores differently (RTN int4 of a random model moves every logprob)
    assert before["metrics"]["lmkit_pydoc_nextword"]["perplexity"] != after["metrics"]["lmkit_pydoc_nextword"]["perplexity"]
    # the paired differences: acc is per document (mean-aggregated); after - before as the two tables give it
    diffs = {d["metric"]: d for d in report["task_differences"] if d["task"] == "lmkit_pydoc_nextword"}
    acc = diffs["acc"]
    assert acc["documents"] == 8 and acc["stderr"] is not None
    assert abs(acc["difference"] - (after["metrics"]["lmkit_pydoc_nextword"]["acc"]["value"]
                                    - before["metrics"]["lmkit_pydoc_nextword"]["acc"]["value"])) < 1e-9
    assert acc["before"] == before["metrics"]["lmkit_pydoc_nextword"]["acc"]["value"]
