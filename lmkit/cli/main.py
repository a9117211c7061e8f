"""The `lmkit` command. Each command wraps one typed, documented function."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import typer
from typer.core import TyperCommand

from lmkit.config import EngineConfig
from lmkit.messages import GenerationConfig
from lmkit.model_path import MODEL_HELP, InvalidModelFolderError, ModelNotFoundError, resolve_model

# rich_markup_mode=None: click's plain help, which wraps option help beside whole option names at any width
# (rich's tables cut long option names short, with "…", to fit 80 columns)
app = typer.Typer(help="lmkit: compress, run and serve large language models.", no_args_is_help=True,
                  add_completion=False, rich_markup_mode=None)


@app.callback()
def _root() -> None:
    """lmkit: compress, run and serve large language models."""


from lmkit.lite.cli import app as lite_app  # noqa: E402  (lmkit lite awq | ppl)

app.add_typer(lite_app, name="lite")

from lmkit.serve.cli import (  # noqa: E402  (lmkit serve api_server | proxy; lmkit chat; shared options)
    MAX_NEW_TOKENS, MIN_P, REPETITION_PENALTY, SEED, TEMPERATURE, TOP_K, TOP_P, app as serve_app, chat,
    model_sampling)

app.add_typer(serve_app, name="serve")
app.command("chat")(chat)


class _ModelPromptCommand(TyperCommand):
    """Usage line `[MODEL] PROMPT`: click sees two optional arguments, and one given alone is the prompt."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        return [self.options_metavar, "[MODEL] PROMPT"]


_E = EngineConfig.field_help()


def names_a_model(arg: str) -> bool:
    """Whether a lone argument of `lmkit generate` is a model rather than a prompt: an existing file or folder,
    a name ending in .gguf, or one word with a slash (a relative path or an owner/name hub id)."""
    return Path(arg).expanduser().exists() or arg.lower().endswith(".gguf") or ("/" in arg and not arg.split()[1:])


@app.command(cls=_ModelPromptCommand)
def generate(
    ctx: typer.Context,
    model: Optional[str] = typer.Argument(None, metavar="MODEL", show_default=False, help=MODEL_HELP),
    prompt: Optional[str] = typer.Argument(None, metavar="PROMPT", show_default=False,
                                           help="The message to answer, as a user turn through the model's chat "
                                                "template (with --raw: text to continue). Given alone, it goes to "
                                                "the bundled model."),
    raw: bool = typer.Option(False, "--raw", help="Send PROMPT as plain text for the model to continue, not as a "
                                                  "chat turn (models without a chat template always get it so)."),
    max_new_tokens: Optional[int] = MAX_NEW_TOKENS,
    temperature: Optional[float] = TEMPERATURE,
    top_p: Optional[float] = TOP_P,
    top_k: Optional[int] = TOP_K,
    min_p: Optional[float] = MIN_P,
    repetition_penalty: Optional[float] = REPETITION_PENALTY,
    seed: Optional[int] = SEED,
    num_threads: Optional[int] = typer.Option(None, help=_E["num_threads"]),
    dtype: str = typer.Option(EngineConfig.dtype, help=_E["dtype"]),
    speculative: str = typer.Option(EngineConfig.speculative, help=_E["speculative"]),
    draft_model: Optional[str] = typer.Option(None, help=_E["draft_model"], show_default=False),
    quantization: str = typer.Option(EngineConfig.quantization, help=_E["quantization"]),
) -> None:
    """Answer one prompt on stdout (streamed; a line of figures follows on stderr). Sampling options left out take
    the model's values from its generation_config.json (greedy when it sets none)."""
    if prompt is None:
        if model is None:
            ctx.fail("Missing argument 'PROMPT'.")
        if names_a_model(model):
            ctx.fail(f"Missing argument 'PROMPT': {model!r} names a model (a path, a .gguf file or a hub id); the "
                     f"prompt goes after it. To send it as the prompt: lmkit generate smollm2 {model!r}")
        model, prompt = None, model
    try:
        path = resolve_model(model)
    except (ModelNotFoundError, InvalidModelFolderError) as e:
        if model is None:
            raise
        raise type(e)(f"{e} (MODEL comes first: lmkit generate [MODEL] PROMPT; quote a prompt with spaces)") \
            from None
    gen = model_sampling(path, max_new_tokens, temperature, top_p, top_k, min_p, repetition_penalty, seed)
    raise typer.Exit(run_generate(path, prompt, EngineConfig(num_threads=num_threads, dtype=dtype,
                                                             speculative=speculative, quantization=quantization,
                                                             draft_model=draft_model),
                                  gen, raw=raw))


def run_generate(model: str | Path | None, prompt: str, engine_config: EngineConfig | None = None,
                 gen_config: GenerationConfig | None = None, raw: bool = False) -> int:
    """Streams the answer to ``prompt`` to stdout, then a line of figures on stderr; returns the exit status.
    ``prompt`` goes as a user turn through the model's chat template, or as plain text to continue with ``raw``
    or for a model without a chat template. ``gen_config`` None: the model's generation defaults. A model that
    answers in harmony channels (gpt-oss) has its analysis channel written to stderr, its answer to stdout."""
    from lmkit import pipeline
    from lmkit.serve.chat import answer_deltas

    with pipeline(model, engine_config) as pipe:
        chat = not raw and pipe.tokenizer.has_chat_template
        start = time.perf_counter()
        first = None
        n = prompt_len = 0
        thought = False
        for r, text, reasoning in answer_deltas(pipe, [{"role": "user", "content": prompt}] if chat else prompt,
                                                gen_config, split=chat):
            if first is None and r.token_ids:
                first = time.perf_counter()
            n, prompt_len = r.generate_token_len, r.input_token_len
            sys.stderr.write(reasoning)  # gpt-oss: its analysis channel to stderr, its answer to stdout
            thought = thought or bool(reasoning)
            sys.stdout.write(text)
            sys.stdout.flush()
            if r.finish_reason == "error":
                typer.echo(f"\nerror: {r.error}", err=True)
                return 1
        end = time.perf_counter()
        sys.stdout.write("\n")
        if thought:
            sys.stderr.write("\n")
        decode = (n - 1) / (end - first) if first and n > 1 and end > first else float("nan")
        typer.echo(f"[{n} tokens for a {prompt_len}-token {'chat' if chat else 'raw'} prompt, first after "
                   f"{((first or end) - start) * 1e3:.0f} ms, {decode:.1f} tok/s decode]", err=True)
        if n == 0 and raw and pipe.tokenizer.has_chat_template:
            typer.echo("(the model ended its text at once: an instruct model answers a chat turn, so leave out "
                       "--raw)", err=True)
    return 0


def serve_model_first(args: list[str]) -> list[str]:
    """``lmkit serve MODEL [OPTIONS]`` (as ``vllm serve MODEL``) and ``lmkit serve --OPTION ...`` are
    ``lmkit serve api_server ...``; ``lmkit serve`` alone and ``lmkit serve --help`` show the group's help."""
    if len(args) < 2 or args[0] != "serve" or args[1] in ("--help", "-h"):
        return args
    commands = {c.name or c.callback.__name__ for c in serve_app.registered_commands}
    return args if args[1] in commands else ["serve", "api_server", *args[1:]]


def main() -> None:
    try:
        app(args=serve_model_first(sys.argv[1:]), standalone_mode=True)
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # user-facing problems: no traceback
        typer.echo(f"error: {e}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
