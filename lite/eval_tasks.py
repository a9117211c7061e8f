"""lm-evaluation-harness tasks built offline from the held-out evaluation text (corpora.py: Hamlet and the
held-out pydoc topics; calibration never reads either), written as lm-eval task YAML + JSONL into a folder that
``lmkit lite eval`` hands to lm-eval as an include path.

  lmkit_hamlet_nextline  multiple choice: two lines of a speech, then its next line among 4 (3 lines drawn from
                         elsewhere in the play, of similar length); acc and acc_norm
  lmkit_hamlet_nextword  next word (LAMBADA's form): two lines and the next line up to its last word; acc (the
                         word is the greedy continuation) and perplexity
  lmkit_pydoc_nextword   the same over the held-out Python documentation prose

The examples are a pure function of the text and TASKS_VERSION (fixed seeds), so every model is scored on the
same items; a changed builder gets a new version and folder.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Iterable
from pathlib import Path

from lmkit.lite.corpora import hamlet, pydoc_evaluation

TASKS_VERSION = 1
NUM_CHOICES = 4
MAX_EXAMPLES = 500

_WORD_END = re.compile(r"^(?P<context>.*\S)\s+(?P<word>[A-Za-z][A-Za-z']{2,})(?P<tail>[^A-Za-z']*)$")


def _runs(lines: Iterable[tuple[str, bool]]) -> list[list[str]]:
    """The runs of consecutive kept lines of (line, keep) pairs."""
    return [[line for line, _ in group] for keep, group in itertools.groupby(lines, key=lambda x: x[1]) if keep]


def _hamlet_speeches() -> list[list[str]]:
    """Hamlet's verse and prose lines, grouped by speech (a speaker's heading, a stage direction or a blank
    line ends one)."""
    lines = (raw.strip() for raw in hamlet()[0].splitlines())
    return _runs((line, bool(line) and not line.startswith(("**", "_", "#"))) for line in lines)


def _pydoc_paragraphs() -> list[list[str]]:
    """Runs of prose lines of the held-out pydoc topics (grammar blocks, headings and code skipped)."""
    def prose(raw: str) -> tuple[str, bool]:
        line = raw.rstrip()
        return line, bool(line) and not raw.startswith(" ") and not set(line) <= set("*=-~")

    return [run for text in pydoc_evaluation() for run in _runs(map(prose, text.splitlines()))]


def _spread(items: list, limit: int) -> list:
    """At most ``limit`` of items, evenly spread over them (order kept)."""
    if len(items) <= limit:
        return items
    return [items[i * len(items) // limit] for i in range(limit)]


def hamlet_nextline(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    speeches = _hamlet_speeches()
    pool = [line for s in speeches for line in s if len(line) >= 12]
    items = []
    for s in speeches:
        for i in range(2, len(s)):
            if len(s[i]) >= 12:
                items.append((s[i - 2], s[i - 1], s[i]))
    examples = []
    for a, b, answer in _spread(items, MAX_EXAMPLES):
        near = [line for line in rng.sample(pool, 64) if line != answer and abs(len(line) - len(answer)) <= 12]
        distractors = list(dict.fromkeys(near))[:NUM_CHOICES - 1]
        if len(distractors) < NUM_CHOICES - 1:
            continue
        choices = distractors + [answer]
        rng.shuffle(choices)
        examples.append({"context": f"{a}\n{b}\n", "choices": choices, "gold": choices.index(answer)})
    return examples


def _nextword(blocks: list[list[str]], lines_before: int) -> list[dict]:
    items = []
    for block in blocks:
        for i in range(lines_before, len(block)):
            m = _WORD_END.match(block[i])
            if m is None:
                continue
            before = "\n".join(block[i - lines_before:i] + [m.group("context")])
            items.append({"context": before, "target": " " + m.group("word")})
    return _spread(items, MAX_EXAMPLES)


def hamlet_nextword() -> list[dict]:
    return _nextword(_hamlet_speeches(), 2)


def pydoc_nextword() -> list[dict]:
    return _nextword(_pydoc_paragraphs(), 1)


_MULTIPLE_CHOICE = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: {version}
"""

_NEXT_WORD = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: context
doc_to_target: target
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
metadata:
  version: {version}
"""

BUILDERS = {
    "lmkit_hamlet_nextline": (hamlet_nextline, _MULTIPLE_CHOICE),
    "lmkit_hamlet_nextword": (hamlet_nextword, _NEXT_WORD),
    "lmkit_pydoc_nextword": (pydoc_nextword, _NEXT_WORD),
}
LOCAL_TASKS = tuple(BUILDERS)


def write_local_tasks(folder: Path, names: list[str] | None = None) -> Path:
    """Writes the YAML + JSONL of the named local tasks (all by default) into ``folder`` (kept if already there at
    this TASKS_VERSION) and returns it: lm-eval's include path."""
    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    for name in names or LOCAL_TASKS:
        build, template = BUILDERS[name]
        data = folder / f"{name}.v{TASKS_VERSION}.jsonl"
        if not data.exists():
            tmp = data.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(e) + "\n" for e in build()), encoding="utf-8")
            tmp.replace(data)
        (folder / f"{name}.yaml").write_text(template.format(name=name, data=json.dumps(str(data)),
                                                              version=TASKS_VERSION), encoding="utf-8")
    return folder
