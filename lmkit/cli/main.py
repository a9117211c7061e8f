"""The `lmkit` command. Each command wraps one typed, documented function."""

from __future__ import annotations

import sys
import time
from typing import Optional

import typer

app = typer.Typer(help="lmkit: compress, run and serve large language models.", no_args_is_help=True,
                  add_completion=False)


@app.callback()
def _root() -> None:
    """lmkit: compress, run and serve large language models."""


from lmkit.lite.cli import app as lite_app  # noqa: E402  (lmkit lite awq | ppl)

app.add_typer(lite_app, name="lite")

from lmkit.serve.cli import app as serve_app, chat  # noqa: E402  (lmkit serve api_server | proxy; lmkit chat)

app.add_typer(serve_app, name="serve")
app.command("chat")(chat)


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="Text to continue (use --chat to send it as a user message)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="HF model folder; default: bundled SmolLM2-135M-Instruct."),
    chat: bool = typer.Option(False, help="Render the prompt with the model's chat template as a user turn."),
    max_new_tokens: int = typer.Option(64, help="Tokens to generate at most."),
    temperature: float = typer.Option(0.0, help="0: greedy; > 0: sample at this temperature."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass, in (0, 1]."),
    top_k: int = typer.Option(0, help="Keep the k most likely tokens (0: off)."),
    seed: Optional[int] = typer.Option(None, help="Random seed for sampling."),
    num_threads: Optional[int] = typer.Option(None, help="CPU threads (default: all cores)."),
    dtype: str = typer.Option("auto", help="auto | float32 | bfloat16 (CPU linear layers as bf16 dot products, "
                                           "AVX512_BF16 CPUs: faster prefill and batches)."),
) -> None:
    """Generate text for one prompt, streamed to stdout, then a line of figures on stderr."""
    from lmkit import EngineConfig, GenerationConfig, pipeline

    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                           temperature=temperature if temperature > 0 else 1.0, top_p=top_p, top_k=top_k,
                           random_seed=seed)
    prompts = [{"role": "user", "content": prompt}] if chat else prompt
    with pipeline(model, EngineConfig(num_threads=num_threads, dtype=dtype)) as pipe:
        start = time.perf_counter()
        first = None
        n = 0
        for r in pipe.stream_infer(prompts, gen):
            if first is None and r.token_ids:
                first = time.perf_counter()
            n = r.generate_token_len
            sys.stdout.write(r.text)
            sys.stdout.flush()
            if r.finish_reason == "error":
                typer.echo(f"\nerror: {r.error}", err=True)
                raise typer.Exit(1)
        end = time.perf_counter()
        sys.stdout.write("\n")
        decode = (n - 1) / (end - first) if first and n > 1 and end > first else float("nan")
        typer.echo(f"[{n} tokens, first after {((first or end) - start) * 1e3:.0f} ms, "
                   f"{decode:.1f} tok/s decode]", err=True)


def main() -> None:
    try:
        app(standalone_mode=True)
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # user-facing problems: no traceback
        typer.echo(f"error: {e}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
