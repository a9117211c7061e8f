"""A first run that works: `lmkit generate "question"` answers it (chat template for instruct models, --raw for
plain text), generation defaults come from the model's generation_config.json, and every command's --help
reads whole at 80 columns."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

FIGURES = re.compile(r"^\[(\d+) tokens for a (\d+)-token (chat|raw) prompt, first after \d+ ms, "
                     r"(nan|[\d.]+) tok/s decode\]$")


def lmkit(*args: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmkit", *args], capture_output=True, text=True, timeout=timeout_s)


def test_readme_first_command_answers_paris(smollm2_path):
    """The README's first command, as written (the bundled model, no options): one clean line naming Paris on
    stdout, the figures line on stderr, nothing else (raw text gave ' Paris.\\n\\nThe answer is: 2018-...')."""
    run = lmkit("generate", "What is the capital of France?")
    assert run.returncode == 0, run.stderr
    answer = run.stdout.strip()
    assert "Paris" in answer and "\n" not in answer and len(answer) < 120, run.stdout
    assert "<|" not in answer and "France" in answer, run.stdout  # no template tokens; an answer, not a fragment
    (figures,) = run.stderr.strip().splitlines()
    assert FIGURES.match(figures) and FIGURES.match(figures).group(3) == "chat", run.stderr


@pytest.fixture(scope="module")
def tiny_with_defaults(tiny_llama, tmp_path_factory):
    """The tiny Llama (byte tokenizer with a chat template) whose generation_config.json sets greedy defaults
    that change its output: a strong repetition penalty and 7 new tokens at most."""
    folder = tmp_path_factory.mktemp("tiny-defaults") / "model"
    shutil.copytree(tiny_llama[0], folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    gen.update(repetition_penalty=1.8, max_new_tokens=7)
    (folder / "generation_config.json").write_text(json.dumps(gen))
    return folder


def test_generate_sends_a_chat_turn_unless_raw(tiny_llama, tiny_llama_pipe):
    """`generate MODEL PROMPT` renders PROMPT as a user turn with the chat template; --raw sends the text itself.
    The output is the pipeline's for that prompt, and the figures line counts the prompt's tokens."""
    from lmkit import GenerationConfig

    gen = GenerationConfig(max_new_tokens=6)
    messages = [{"role": "user", "content": "hello"}]
    for extra, prompt, kind in (((), messages, "chat"), (("--raw",), "hello", "raw"),
                                (("--speculative", "ngram", "--dtype", "float32"), messages, "chat")):  # drafts
        run = lmkit("generate", str(tiny_llama[0]), "hello", "--max-new-tokens", "6", "--temperature", "0", *extra)
        assert run.returncode == 0, run.stderr
        assert run.stdout == tiny_llama_pipe(prompt, gen).text + "\n"
        match = FIGURES.match(run.stderr.strip().splitlines()[-1])
        assert match and match.group(3) == kind, run.stderr
        assert int(match.group(2)) == len(tiny_llama_pipe.encode(prompt))
    assert len(tiny_llama_pipe.encode(messages)) > len(tiny_llama_pipe.encode("hello")) + 5  # the template's tokens


@pytest.mark.slow
def test_generate_argument_errors(tiny_llama, tmp_path):
    """One argument is the prompt; a model (a path, a .gguf name, a hub id) alone, a missing model, or no prompt are
    clear usage errors."""
    run = lmkit("generate")
    assert run.returncode == 2 and "Missing argument 'PROMPT'" in run.stderr
    for alone in (str(tiny_llama[0]), str(tmp_path / "no" / "such" / "folder"), "model.gguf", "Owner/name"):
        run = lmkit("generate", alone)  # a path or a hub id alone is a model without a prompt, never a prompt
        assert run.returncode == 2 and "names a model" in run.stderr and "the prompt goes after it" in run.stderr
    run = lmkit("generate", str(tmp_path / "missing"), "hello")
    assert run.returncode == 1 and "does not exist" in run.stderr and "lmkit generate [MODEL] PROMPT" in run.stderr
    run = lmkit("generate", str(tiny_llama[0]), "hello", "--speculative", "mtp")  # a model without an MTP head
    assert run.returncode == 1 and "speculative='mtp' needs a model with a multi-token-prediction head" in run.stderr
    assert "Traceback" not in run.stderr


def test_generation_defaults_come_from_the_model(tiny_with_defaults, tmp_path):
    """generation_config.json's sampling fields become the model's defaults (config.json's when there is no
    generation_config.json); given values override them, None keeps them, temperature 0 is greedy; an invalid
    one names the file."""
    from lmkit.models import load_model_spec, read_generation_defaults

    folder = tmp_path / "sampled"
    shutil.copytree(tiny_with_defaults, folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.8, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
         "max_length": 99, "eos_token_id": 257}))
    spec = load_model_spec(folder)
    assert spec.generation_defaults == dict(do_sample=True, temperature=0.6, top_p=0.8, top_k=20, min_p=0.05,
                                            repetition_penalty=1.1)
    gen = spec.generation_config()
    assert (gen.do_sample, gen.temperature, gen.top_p, gen.top_k, gen.min_p, gen.repetition_penalty,
            gen.max_new_tokens) == (True, 0.6, 0.8, 20, 0.05, 1.1, 512)  # max_length is not max_new_tokens
    gen = spec.generation_config(temperature=None, top_p=0.5, top_k=None, max_new_tokens=9)
    assert (gen.do_sample, gen.temperature, gen.top_p, gen.top_k, gen.max_new_tokens) == (True, 0.6, 0.5, 20, 9)
    assert not spec.generation_config(temperature=0).do_sample
    assert load_model_spec(tiny_with_defaults).generation_config(temperature=0.9).do_sample  # greedy model, asked

    (folder / "generation_config.json").unlink()  # transformers' fallback: config.json's fields
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "do_sample": True, "temperature": 0.7}))
    assert read_generation_defaults(folder) == {"do_sample": True, "temperature": 0.7}
    (folder / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    with pytest.raises(ValueError, match=r"generation_config.json: a generation default is invalid: top_p"):
        load_model_spec(folder)


def test_pipeline_and_cli_use_the_model_defaults(tiny_with_defaults):
    """pipe(prompt) and stream_infer(prompt) without a config run with the model's defaults, and so do
    `lmkit generate` and `lmkit chat` for the options not given."""
    from lmkit import EngineConfig, GenerationConfig, pipeline

    explicit = GenerationConfig(max_new_tokens=7, repetition_penalty=1.8)
    messages = [{"role": "user", "content": "ab"}]
    with pipeline(tiny_with_defaults, EngineConfig(device="cpu", cache_max_entry_count=64)) as pipe:
        assert pipe.engine.generation_defaults == {"repetition_penalty": 1.8, "max_new_tokens": 7}
        expected = pipe("ab", explicit)
        assert pipe("ab").token_ids == expected.token_ids and len(expected.token_ids) <= 7
        assert pipe("ab", GenerationConfig(max_new_tokens=7)).token_ids != expected.token_ids  # the penalty shows
        assert [t for r in pipe.stream_infer("ab") for t in r.token_ids] == expected.token_ids
        chat_expected = pipe(messages, explicit).text
        overridden = pipe(messages, GenerationConfig(max_new_tokens=3, repetition_penalty=1.8)).text

    run = lmkit("generate", str(tiny_with_defaults), "ab", "--raw")
    assert run.returncode == 0 and run.stdout == expected.text + "\n", run.stderr
    run = lmkit("generate", str(tiny_with_defaults), "ab", "--max-new-tokens", "3")
    assert run.returncode == 0 and run.stdout == overridden + "\n", run.stderr
    run = lmkit("chat", str(tiny_with_defaults), "--prompt", "ab", "--session-len", "512", "--num-threads", "1")
    assert run.returncode == 0 and run.stdout == chat_expected + "\n", run.stderr


def _commands(command, path=()):
    """(name path, click command) of every command under the root, groups included."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def test_every_help_reads_whole_at_80_columns():
    """At COLUMNS=80 every command's --help shows each option name whole (rich's tables cut them to "…"), has no
    line over 80 characters, and no option's help runs past a few lines (--dtype's took ~45)."""
    import typer
    from typer.testing import CliRunner

    from lmkit.cli.main import app

    root = typer.main.get_command(app)
    seen = set()
    for path, command in _commands(root):
        result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80"}, prog_name="lmkit")
        out = result.output
        where = "lmkit " + " ".join(path)
        assert result.exit_code == 0, (where, out)
        assert "…" not in out, (where, out)
        assert max(len(line) for line in out.splitlines()) <= 80, (where, out)
        names = [n for p in command.params for n in (*p.opts, *p.secondary_opts) if n.startswith("-")]
        for name in names:
            assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", out), (where, name, out)
        options = out.split("\nOptions:\n", 1)[1].split("\n\n", 1)[0].splitlines()
        entries: list[list[str]] = []
        for line in options:
            if re.match(r"^  -", line):
                entries.append([line])
            elif entries:
                entries[-1].append(line)
        num_options = len([p for p in command.params if p.param_type_name == "option"]) + 1  # and --help
        assert len(entries) == num_options, (where, out)
        for entry in entries:
            assert len(entry) <= 7, (where, "\n".join(entry))
        seen.add(path)
    assert {("generate",), ("chat",), ("serve", "api_server"), ("serve", "proxy"), ("lite", "awq"), ("lite", "ppl"),
            ("lite", "calibrate")} <= seen
