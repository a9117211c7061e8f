"""Tiny random models that speak the real families' chat formats: the byte tokenizer plus each family's
special and added tokens, and the family's own chat template (tests/fixtures/chat_templates, verbatim copies)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.conftest import make_tiny_model

TEMPLATES = Path(__file__).resolve().parent.parent / "fixtures" / "chat_templates"

_CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@dataclass(frozen=True)
class Family:
    name: str
    template: str
    special: tuple[str, ...]
    """Special tokens (left out of decoded text)."""
    added: tuple[str, ...]
    """Added tokens that are text (Qwen's <tool_call>, <think>)."""
    bos: str | None
    eos: str
    tool_parser: str | None
    reasoning: str | None = None


FAMILIES = {f.name: f for f in (
    Family("qwen2.5", "qwen2.5.jinja", _CHATML, ("<tool_call>", "</tool_call>"), None, "<|im_end|>", "hermes"),
    Family("qwen3", "qwen3.jinja", _CHATML, ("<tool_call>", "</tool_call>", "<think>", "</think>"), None,
           "<|im_end|>", "hermes", "qwen3"),
    Family("llama3.1", "llama3.1.jinja", ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                          "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"), (),
           "<|begin_of_text|>", "<|eot_id|>", "llama3_json"),
    Family("mistral", "mistral.jinja", ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                        "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), (),
           "<s>", "</s>", "mistral"),
    Family("qwen3_coder", "qwen3_coder.jinja", _CHATML, ("<tool_call>", "</tool_call>"), None, "<|im_end|>",
           "qwen3_coder"),
    Family("deepseek_r1", "deepseek_r1_distill.jinja",
           ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"), ("<think>", "</think>"),
           "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", None, "deepseek_r1"),
)}


def make_family_model(folder: Path, family: Family, seed: int = 0) -> Path:
    """A tiny llama-shaped model with ``family``'s tokens and chat template, saved into ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"additional_special_tokens": list(family.special)})
    fast.add_tokens(list(family.added))
    fast.eos_token = family.eos
    if family.bos:
        fast.bos_token = family.bos
    fast.chat_template = (TEMPLATES / family.template).read_text()
    vocab = len(fast)
    make_tiny_model(folder, "llama", seed=seed, vocab_size=vocab + (-vocab) % 8,
                    bos_token_id=fast.convert_tokens_to_ids(family.bos) if family.bos else None,
                    eos_token_id=fast.convert_tokens_to_ids(family.eos))
    for f in folder.glob("*token*"):  # the byte tokenizer make_tiny_model wrote
        f.unlink()
    fast.save_pretrained(str(folder))
    return folder
