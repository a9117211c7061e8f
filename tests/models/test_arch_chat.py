"""`lmkit chat` on each model family issue 22 adds, with that family's chat format in its tokenizer: the
answer on stdout is HF transformers' for the same conversation (the template rendered and tokenized by
transformers' tokenizer, greedy HF generate, decoded without special tokens). Both in fp32: in bf16 a random tiny
model's near-ties fall either way (gemma4_e's did on the AMX Xeon), and the test is about the chat path.

The tiny models are the cases of tests/models/test_architectures.py (tests/factories.py's ARCH_CASES); their byte
tokenizer gets the family's turn markers as special tokens and a chat template in the family's format (the hub templates' turn structure, without
their tool and system-prompt branches; Gemma 4's own template verbatim). Gemma's tokenizer also adds <bos> on plain encodes, as the real
one does, while its template writes {{ bos_token }} itself: the prompt must hold one BOS, not two.

    pytest tests/models/test_arch_chat.py [-k gemma3]
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from tests.factories import TEMPLATES, build_case


@dataclass(frozen=True)
class ChatFormat:
    template: str
    specials: tuple[str, ...]  # turn markers, added as special tokens
    eos: str  # the token that ends an assistant turn (the generation's stop token)
    bos_on_encode: bool = False  # the tokenizer's post-processor prepends <s> (the byte tokenizer's bos)


CHATML = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
FORMATS = {
    # Qwen3: ChatML; an answer without thinking opens with an empty think block
    "qwen3": ChatFormat(CHATML.replace("'<|im_start|>assistant\\n' }}",
                                       "'<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}"),
                        ("<|im_start|>", "<|im_end|>", "<think>", "</think>"), "<|im_end|>"),
    # Gemma 2 / 3: <bos> from the template, turns of user and model
    "gemma3": ChatFormat("{{ bos_token }}{%- for m in messages -%}"
                         "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
                         "{{ '<start_of_turn>' + role + '\\n' + m['content'] | trim + '<end_of_turn>\\n' }}"
                         "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}",
                         ("<start_of_turn>", "<end_of_turn>"), "<end_of_turn>", bos_on_encode=True),
    # Gemma 4: its own template, verbatim (tests/fixtures/chat_templates): <bos> from the template, turns between
    # <|turn> and <turn|>, the generation prompt closing an empty thought channel (thinking off)
    "gemma4": ChatFormat((TEMPLATES / "gemma4.jinja").read_text(),
                         ("<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>"), "<turn|>",
                         bos_on_encode=True),
    # Phi-3 / Phi-4-mini: <|role|>content<|end|>
    "phi3_longrope_partial": ChatFormat("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}"
                                        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}",
                                        ("<|user|>", "<|assistant|>", "<|system|>", "<|end|>"), "<|end|>"),
    # SmolLM3: ChatML
    "smollm3": ChatFormat(CHATML, ("<|im_start|>", "<|im_end|>"), "<|im_end|>"),
}
FORMATS["gemma2"] = FORMATS["gemma3"]
FORMATS["gemma4_e"] = FORMATS["gemma4"]
NEW_TOKENS = 12
QUESTION = "Name a colour."


def write_chat_tokenizer(folder, fmt: ChatFormat) -> None:
    """The byte tokenizer of test_architectures' cases (256 bytes, <s> = 256, </s> = 257) plus the family's
    special tokens (258, ...) and its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token=None)
    fast.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>", "additional_special_tokens": list(fmt.specials)})
    if fmt.bos_on_encode:
        fast.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", fast.convert_tokens_to_ids("<s>"))])
    fast.chat_template = fmt.template
    fast.save_pretrained(str(folder))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_chat_answers_as_hf_with_the_family_template(name, tmp_path):
    from transformers import AutoTokenizer

    fmt = FORMATS[name]
    folder = tmp_path / name
    ref = build_case(name, folder)
    write_chat_tokenizer(folder, fmt)
    hf_tok = AutoTokenizer.from_pretrained(str(folder))
    ids = hf_tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    assert ids.count(hf_tok.bos_token_id) == (1 if fmt.bos_on_encode else 0), ids
    assert max(ids) < ref.config.vocab_size
    stop_id = hf_tok.convert_tokens_to_ids(fmt.eos)
    # as the hub models do: the end-of-turn token is one of generation_config.json's eos ids
    gen_path = folder / "generation_config.json"
    gen_path.write_text(json.dumps({**json.loads(gen_path.read_text()), "eos_token_id": [hf_tok.eos_token_id, stop_id]}))
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                           eos_token_id=[hf_tok.eos_token_id, stop_id], pad_token_id=hf_tok.eos_token_id)
    want = hf_tok.decode(out[0, len(ids):], skip_special_tokens=True)

    run = subprocess.run([sys.executable, "-m", "lmkit", "chat", str(folder), "--prompt", QUESTION,
                          "--max-new-tokens", str(NEW_TOKENS), "--temperature", "0", "--session-len", "512",
                          "--num-threads", "1", "--dtype", "float32"], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    assert run.stdout == want + "\n", (
        f"{name}: lmkit chat answered {run.stdout!r}, HF {want!r} (prompt ids {ids})")
