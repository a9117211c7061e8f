"""`lmkit generate` and `lmkit chat --prompt` on a model that answers in harmony channels (gpt-oss): its analysis goes
to stderr (the chat shows it dim), its answer to stdout, and the markers to neither. The tiny gpt_oss chat family
(tests/factories.py) is forced through one such answer by a grammar of its special tokens."""

from __future__ import annotations

from lmkit import EngineConfig, GenerationConfig
from lmkit.structured import StructuredOutput
from tests.factories import FAMILIES, make_family_model

ENGINE = EngineConfig(device="cpu", max_batch_size=2, cache_max_entry_count=64, session_len=2048)


def forced_answer(folder) -> GenerationConfig:
    from lmkit.tokenizer import Tokenizer

    tokenizer = Tokenizer(folder)
    ch, msg, end, start = (f"<[{tokenizer.single_token_id(m)}]>"
                           for m in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>"))
    lark = (f'start: {ch} "analysis" {msg} "first a plan" {end} {start} "assistant" {ch} "final" {msg} '
            f'"the answer"')
    return GenerationConfig(max_new_tokens=60, structured_output=StructuredOutput(grammar=lark))


def test_generate_and_chat_split_harmony_channels(tmp_path, capsys):
    from lmkit.cli.main import run_generate
    from lmkit.serve.chat import run_chat

    folder = make_family_model(tmp_path / "gpt_oss", FAMILIES["gpt_oss"])
    gen = forced_answer(folder)
    capsys.readouterr()  # the model's build
    assert run_generate(folder, "hi", ENGINE, gen) == 0
    out, err = capsys.readouterr()
    assert out == "the answer\n" and err.startswith("first a plan\n[50 tokens"), repr((out, err))
    assert run_chat(str(folder), ENGINE, gen, prompt="hi") == 0
    out, err = capsys.readouterr()
    assert (out, err) == ("the answer\n", "first a plan\n")
