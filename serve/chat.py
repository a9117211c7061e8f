"""`lmkit chat`: a terminal chat with a local model. Multi-turn history, streamed answers rendered with
rich, /reset and /exit; Ctrl-C stops the current answer (its engine request is cancelled) and the chat
goes on. ``prompt=...`` answers one message on stdout and returns (for scripts). A model that answers in harmony
channels (gpt-oss) has its analysis shown as reasoning (dim; on stderr with ``prompt``) and only its answer kept."""

from __future__ import annotations

import dataclasses
import signal
import sys

from lmkit.config import EngineConfig
from lmkit.messages import GenerationConfig

HELP = "/reset clears the history, /exit quits, Ctrl-C stops the current answer"


def channels_of(pipe, gen: GenerationConfig):
    """(gen, parser): for a model whose chat template writes harmony channels (gpt-oss), ``gen`` keeping the special
    tokens and a parser of the channels (its ``feed`` gives (reasoning, answer) deltas); else (gen, None)."""
    from lmkit.serve.reasoning import HarmonyFormat, detect_reasoning_format

    fmt = detect_reasoning_format(pipe.tokenizer.chat_template)
    if not isinstance(fmt, HarmonyFormat):
        return gen, None
    return dataclasses.replace(gen, skip_special_tokens=False), fmt.new_parser(False)


def answer_deltas(pipe, prompt, gen: GenerationConfig | None, split: bool = True):
    """(response, answer delta, reasoning delta) of each response streamed for ``prompt`` (chat messages, or text);
    with ``split``, a model that answers in harmony channels has them split (channels_of), else it is all answer.
    ``gen`` None: the model's generation defaults. Closing the generator cancels the request."""
    channels = None
    if split:
        gen, channels = channels_of(pipe, gen or pipe.engine.default_generation_config())
    responses = pipe.stream_infer(prompt, gen)
    try:
        for r in responses:
            text, reasoning = r.text, ""
            if channels is not None:
                reasoning, text = channels.feed(text, final=r.finish_reason is not None)
            yield r, text, reasoning
    finally:
        responses.close()  # cancels the engine request when we leave early


def _stream(pipe, messages: list[dict], gen: GenerationConfig, on_text) -> tuple[str, str | None]:
    """Streams one answer into ``on_text(answer so far, answer delta, reasoning delta)``; returns (answer,
    finish_reason). KeyboardInterrupt cancels it."""
    parts: list[str] = []
    finish = None
    deltas = answer_deltas(pipe, messages, gen)
    try:
        for r, text, reasoning in deltas:
            if text or reasoning:
                parts.append(text)
                on_text("".join(parts), text, reasoning)
            if r.finish_reason == "error":
                raise RuntimeError(r.error)
            finish = r.finish_reason or finish
    finally:
        deltas.close()
    return "".join(parts), finish


def run_chat(model: str | None = None, engine_config: EngineConfig | None = None,
             gen_config: GenerationConfig | None = None, system: str | None = None,
             prompt: str | None = None) -> int:
    """Chats with ``model`` (default: the bundled SmolLM2) until /exit or end of input; with ``prompt``,
    answers that one message on stdout instead. Returns the exit status."""
    from rich.console import Console

    from lmkit.pipeline import pipeline

    base = [{"role": "system", "content": system}] if system else []
    err = Console(stderr=True)
    with pipeline(model, engine_config) as pipe:
        gen = gen_config or pipe.engine.default_generation_config()  # the model's generation_config.json
        if prompt is not None:
            thought = []

            def write(_, delta, reasoning):
                sys.stderr.write(reasoning)
                thought.append(reasoning)
                sys.stdout.write(delta)
                sys.stdout.flush()

            _stream(pipe, base + [{"role": "user", "content": prompt}], gen, write)
            sys.stdout.write("\n")
            if any(thought):
                sys.stderr.write("\n")
            return 0
        return _interactive(pipe, gen, base, Console(), err)


def _interactive(pipe, gen: GenerationConfig, base: list[dict], console, err) -> int:
    from rich.console import Group
    from rich.live import Live
    from rich.markdown import Markdown
    from rich.text import Text

    # A shell starts background jobs with SIGINT ignored, and Python then leaves it ignored: Ctrl-C would
    # never reach the answer it is meant to stop. The chat is interactive, so it takes Ctrl-C back.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    name = pipe.engine.model_path.name
    console.print(f"[bold]lmkit chat[/bold] with [cyan]{name}[/cyan]  [dim]({HELP})[/dim]")
    history = list(base)
    while True:
        try:
            text = console.input("[bold green]you>[/bold green] ")
        except (EOFError, KeyboardInterrupt):
            console.print()
            return 0
        command = text.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            return 0
        if command == "/reset":
            history = list(base)
            console.print("[dim]history cleared[/dim]")
            continue
        if command.startswith("/") and " " not in command:
            console.print(f"[yellow]unknown command {command}[/yellow] [dim]({HELP})[/dim]")
            continue
        history.append({"role": "user", "content": text})
        console.print("[bold blue]assistant>[/bold blue]")
        stopped = False
        thinking = Text(style="dim italic")

        def show(full, _, reasoning):
            thinking.append(reasoning)
            live.update(Group(thinking, Markdown(full)) if thinking else Markdown(full))

        with Live(Markdown(""), console=console, refresh_per_second=12, vertical_overflow="visible") as live:
            try:
                answer, finish = _stream(pipe, history, gen, show)
            except KeyboardInterrupt:
                stopped = True
                answer, finish = "", None
            except (RuntimeError, ValueError) as e:  # the engine refused or failed: say so, keep chatting
                err.print(f"[red]error: {e}[/red]")
                history.pop()
                continue
        if stopped:
            console.print("[dim](stopped)[/dim]")
            history.pop()  # the question was not answered; the user may ask again
            continue
        if finish == "length":
            console.print("[dim](answer cut at the token limit)[/dim]")
        history.append({"role": "assistant", "content": answer})
