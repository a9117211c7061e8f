"""The tokenizer against transformers' AutoTokenizer (the oracle), which lmkit no longer imports: encode with and
without special tokens, decode with and without skipping them, vocab_size, chat templates rendered and
tokenized, for SmolLM2's tokenizer, the tiny test tokenizers, and tokenizers built here in the layouts of
Llama 3 (BOS from a TemplateProcessing post-processor), Qwen2 (no BOS; its own tokenizer class), a
SentencePiece-style BPE with byte fallback, a WordPiece one (clean-up of tokenization spaces) and a slow-only
folder (vocab.json + merges.txt). Then incremental detokenization: streamed one token at a time, the deltas
join to the oracle's full decode and never end inside a multi-byte character."""

from __future__ import annotations

import json
import random
import re
import shutil

import pytest

from lmkit.chat_template import render_chat_template
from lmkit.tokenizer import SPECIAL_TOKEN_NAMES, IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world, this is a test.",
    "  leading spaces and\ttabs\nand new lines\n\n",
    "Ünïcödé: café, naïve, Straße; 日本語のテキスト; 한국어; emoji 🎉🚀👍🏽 and 👨‍👩‍👧 families",
    "def f(x):\n    return x ** 2  # comment\n",
    "Numbers 1234567890 and symbols !@#$%^&*()_+-=[]{}|;':\",./<>?",
    "whitespace runs:     five,\t\t\ttabs,\n\n\n\nnew lines,   \n  \t mixed  ",
    "combining e\u0301 vs \u00e9, ligature \ufb01, full-width \uff21\uff22, zero width \u200b joiner",
    "Don't stop , he said . It 's fine ! Is it ? We 're done , aren 't we",
    "",
    " ",
]
CORPUS = [t * 4 for t in TEXTS] + ["the quick brown fox jumps over the lazy dog " * 20, "hello world " * 20,
                                   "def return comment numbers symbols " * 10]
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN2_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are Qwen, a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role != 'system' %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n")


def _added(tok, contents) -> dict:
    """added_tokens_decoder entries, as transformers saves them in tokenizer_config.json."""
    return {str(tok.token_to_id(c)): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                      "single_word": False, "special": True} for c in contents}


def _write(folder, tok, config: dict, model_type: str | None = None):
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))
    if model_type:
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return folder


def llama3_style_folder(folder, **config):
    """Llama 3's layout: byte-level BPE split by its regex, <|begin_of_text|> added by a TemplateProcessing
    post-processor (tokenizer_config.json has no add_bos_token), clean_up_tokenization_spaces true (which
    transformers 5 ignores for BPE), tokenizer_class PreTrainedTokenizerFast, model_type llama; plus a
    model-specific special token and an extra special token that are not in tokenizer.json."""
    from tokenizers import Regex, Tokenizer as RustTokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_REGEX), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=500, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>"]
    tok.add_special_tokens(specials)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                      special_tokens=[("<|begin_of_text|>", bos)])])
    return _write(folder, tok, {
        "added_tokens_decoder": _added(tok, specials), "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "clean_up_tokenization_spaces": True, "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": LLAMA3_TEMPLATE,
        "image_token": "<|image|>", "extra_special_tokens": ["<|python_tag|>"], **config}, "llama")


def qwen2_style_folder(folder):
    """Qwen2's layout: NFC, its split regex, byte-level BPE, a ByteLevel post-processor (no BOS), bos_token
    null, tokenizer_class Qwen2Tokenizer and model_type qwen2 (transformers rebuilds the pipeline in its own
    class from vocab and merges)."""
    from tokenizers import Regex, Tokenizer as RustTokenizer, decoders, models, normalizers, pre_tokenizers, \
        processors, trainers

    tok = RustTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_REGEX), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=500, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.add_special_tokens(specials)
    return _write(folder, tok, {
        "add_prefix_space": False, "added_tokens_decoder": _added(tok, specials),
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
        "chat_template": QWEN2_TEMPLATE, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>",
        "errors": "replace", "model_max_length": 32768, "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}, "qwen2")


def sentencepiece_style_folder(folder):
    """A Llama-2-style tokenizer: BPE with byte fallback, Metaspace spaces, the decoder strips one leading space."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = RustTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(folder)
    return folder


def wordpiece_folder(folder):
    """A BERT-style WordPiece tokenizer ([CLS] $A [SEP]) whose decoder leaves spaces before punctuation, with
    clean_up_tokenization_spaces true: transformers cleans them up after decoding (not for BPE)."""
    from tokenizers import Tokenizer as RustTokenizer, decoders, models, normalizers, pre_tokenizers, processors, \
        trainers

    tok = RustTokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=False)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=400, special_tokens=specials,
                                                              show_progress=False))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    return _write(folder, tok, {
        "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "mask_token": "[MASK]", "clean_up_tokenization_spaces": True, "tokenizer_class": "PreTrainedTokenizerFast"})


def byte_folder(folder):
    from tests.factories import write_byte_tokenizer

    write_byte_tokenizer(folder)
    return folder


BUILDERS = {"llama3": llama3_style_folder, "qwen2": qwen2_style_folder, "sentencepiece": sentencepiece_style_folder,
            "wordpiece": wordpiece_folder, "byte": byte_folder}


@pytest.fixture(scope="module", params=["smollm2", "tiny-llama", *BUILDERS])
def pair(request, tmp_path_factory):
    """(lmkit's Tokenizer, transformers' AutoTokenizer, the folder)."""
    from transformers import AutoTokenizer

    if request.param == "smollm2":
        folder = request.getfixturevalue("smollm2_path")
    elif request.param == "tiny-llama":
        folder = request.getfixturevalue("tiny_llama")[0]
    else:
        folder = BUILDERS[request.param](tmp_path_factory.mktemp(request.param))
    return Tokenizer(folder), AutoTokenizer.from_pretrained(str(folder)), folder


def texts_for(oracle) -> list[str]:
    """TEXTS, and texts with the tokenizer's special tokens written in them (whole, glued, cut short)."""
    specials = [t for t in oracle.all_special_tokens if t]
    glued = "".join(specials)
    return TEXTS + [f"a{s}b {s} c{s}" for s in specials] + [glued, f"  {glued}\n", specials[0][:-1] + " x"]


def test_encode_matches_transformers(pair):
    ours, oracle, _ = pair
    assert ours.vocab_size == len(oracle)
    for text in texts_for(oracle):
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == oracle.encode(text, add_special_tokens=add), (text, add)


def test_long_texts_match_transformers_and_leave_the_gil_to_other_threads(pair):
    """A long text (the batch API's path) tokenizes as transformers does, and while it does another thread of
    this process runs: a server's event loop answers /health beside a 600k-character prompt."""
    import threading
    import time

    ours, oracle, _ = pair
    rng = random.Random(5)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "é", "🙂", "\n", "  "]
    text = "".join(rng.choice(words) + " " for _ in range(3000))  # ~14k characters, past the batch threshold
    for add in (True, False):
        assert ours.encode(text, add_special_tokens=add) == oracle.encode(text, add_special_tokens=add)
    ticks, done = [0], threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        time.sleep(0.01)
        before = ticks[0]
        ours.encode(text * 45)  # ~600k characters: about half a second of tokenization
        during = ticks[0] - before
    finally:
        done.set()
        ticker.join()
    assert during >= 10, f"another thread ran {during} times while a long text was tokenized: the GIL was held"


def test_decode_matches_transformers(pair):
    ours, oracle, _ = pair
    rng = random.Random(0)
    specials = oracle.all_special_ids
    for text in texts_for(oracle):
        ids = oracle.encode(text)
        for _ in range(3):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        for skip in (True, False):
            assert ours.decode(ids, skip) == oracle.decode(ids, skip_special_tokens=skip), (text, skip)
    for _ in range(30):  # arbitrary ids: broken UTF-8, added tokens anywhere
        ids = [rng.randrange(len(oracle)) for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            assert ours.decode(ids, skip) == oracle.decode(ids, skip_special_tokens=skip), (ids, skip)


def test_max_token_chars_bounds_the_text_of_one_token(pair):
    ours, oracle, _ = pair
    ids = range(len(oracle))
    longest_decode = max(len(oracle.decode([i], skip_special_tokens=False)) for i in ids)
    longest_piece = max(len(oracle.convert_ids_to_tokens(i) or "") for i in ids)
    assert ours.max_token_chars == max(longest_decode, longest_piece)
    for text in texts_for(oracle):
        assert len(text) <= ours.max_token_chars * max(1, len(ours.encode(text, add_special_tokens=False))), text


CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Sé breve. 日本語"}, {"role": "user", "content": "Ünïcödé?  \n"},
     {"role": "assistant", "content": "Oui 🎉", "tool_calls": None}, {"role": "user", "content": "  again\t"}],
]


def test_model_chat_templates_match_transformers(pair):
    ours, oracle, folder = pair
    every_name = "|".join(f"{{{{ {name} }}}}" for name in (*SPECIAL_TOKEN_NAMES, "image_token", "missing_token"))
    names = Tokenizer(folder, chat_template=every_name + "{{ messages[0].content }}")
    assert names.apply_chat_template(CONVERSATIONS[0]) == oracle.apply_chat_template(
        CONVERSATIONS[0], chat_template=every_name + "{{ messages[0].content }}", add_generation_prompt=True,
        tokenize=True, return_dict=False)
    if not oracle.chat_template:
        assert not ours.has_chat_template
        with pytest.raises(ValueError, match="no chat template"):
            ours.apply_chat_template(CONVERSATIONS[0])
        return
    for messages in CONVERSATIONS:
        for gen in (True, False):
            expected = oracle.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True,
                                                  return_dict=False)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected, (messages, gen)


ROLE_CHECK = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
              "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
              "{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
TEMPLATES = {
    "tojson": "{{ messages | tojson }}|{{ {'k': 'ünï <b>&\"', 'n': [1, 2.5, none, true]} | tojson(indent=2) }}|"
              "{{ messages[0] | tojson(sort_keys=true, separators=(',', ':')) }}",
    "loop_controls": "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
                     "{% if loop.index > 3 %}{% break %}{% endif %}{{ loop.index }}. {{ m.role }}: {{ m.content }}\n"
                     "{% endfor %}",
    "whitespace": "{% for m in messages %}\n    {% if m.role == 'user' %}\n<u>{{ m.content }}</u>\n    {% else %}\n"
                  "  <o>{{ m.content }}</o>\n    {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}\n"
                  "<a>\n{% endif %}",
    "variables": "{{ bos_token }}[{{ eos_token }}][{{ pad_token }}][{{ unk_token is defined }}]"
                 "{{ strftime_now('%Y') }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}",
    "namespace_dict": "{% set ns = namespace(n=0, last='') %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                      "{% set ns.last = m.role %}{% endfor %}{{ ns.n }} {{ ns.last }} {{ dict(a=1, b='é') | tojson }}"
                      "{{ messages[-1].tool_calls is defined }}",
    "generation": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                  "{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}",
    "reasoning": "{% for m in messages %}{{ m.role }}|{{ m.reasoning_content }}|{{ m.thinking }}|{{ m.content }}\n"
                 "{% endfor %}",
    "role_check": ROLE_CHECK,
}
FEATURE_CONVERSATIONS = CONVERSATIONS + [
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "because ü"},
     {"role": "user", "content": "q2", "name": None}],
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
]


@pytest.fixture(scope="module")
def qwen2_pair(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = qwen2_style_folder(tmp_path_factory.mktemp("qwen2-templates"))
    return folder, AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_template_features_match_transformers(qwen2_pair, name):
    """Each Jinja feature transformers' environment has, rendered (text and ids) as transformers renders it;
    where the template raises, both raise with the template's message."""
    import jinja2

    folder, oracle = qwen2_pair
    template = TEMPLATES[name]
    ours = Tokenizer(folder, chat_template=template)
    special_tokens = oracle.special_tokens_map
    for messages in FEATURE_CONVERSATIONS:
        for gen in (True, False):
            try:
                expected = oracle.apply_chat_template(messages, chat_template=template, add_generation_prompt=gen,
                                                      tokenize=False)
            except jinja2.TemplateError as e:
                with pytest.raises(ValueError, match=re.escape(str(e))):
                    ours.apply_chat_template(messages, add_generation_prompt=gen)
                continue
            assert render_chat_template(template, messages, gen, special_tokens) == expected, (messages, gen)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == oracle.apply_chat_template(
                messages, chat_template=template, add_generation_prompt=gen, tokenize=True, return_dict=False)
    if name == "role_check":  # the oracle raised for the last conversation: so did we
        with pytest.raises(ValueError, match="roles must alternate"):
            ours.apply_chat_template(FEATURE_CONVERSATIONS[-1])


def test_underscore_namespace_attributes_and_empty_chats_are_refused(qwen2_pair):
    folder, _ = qwen2_pair
    ours = Tokenizer(folder, chat_template="{% set ns = namespace(n=0) %}{% set ns._secret = 1 %}{{ ns.n }}")
    with pytest.raises(ValueError, match="underscore-prefixed"):
        ours.apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(ValueError, match="at least one message"):
        ours.apply_chat_template([])


def test_template_files_are_found_as_transformers_finds_them(tmp_path):
    """chat_template.jinja wins over tokenizer_config.json; additional_chat_templates/ makes named templates
    (the default one is used); a list of named templates in tokenizer_config.json without a default is an
    error for both."""
    from transformers import AutoTokenizer

    base = llama3_style_folder(tmp_path / "base")
    jinja_file = tmp_path / "jinja"
    shutil.copytree(base, jinja_file)
    (jinja_file / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    named = tmp_path / "named"
    shutil.copytree(jinja_file, named)
    (named / "additional_chat_templates").mkdir()
    (named / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS{{ messages | length }}")
    for folder in (base, jinja_file, named):
        oracle = AutoTokenizer.from_pretrained(str(folder))
        for messages in CONVERSATIONS:
            assert Tokenizer(folder).apply_chat_template(messages) == oracle.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False), folder.name
    no_default = tmp_path / "no-default"
    shutil.copytree(base, no_default)
    config = json.loads((no_default / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "rag", "template": "y"}]
    (no_default / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError):
        AutoTokenizer.from_pretrained(str(no_default)).apply_chat_template(CONVERSATIONS[0], tokenize=False)
    with pytest.raises(ValueError, match="none named 'default'"):
        Tokenizer(no_default).apply_chat_template(CONVERSATIONS[0])


def test_add_bos_eos_flags_follow_transformers(tmp_path):
    """With a tokenizer.json its post-processor decides, whatever add_bos_token / add_eos_token say (transformers 5
    drops them); a tokenizer.json without a post-processor adds nothing."""
    from transformers import AutoTokenizer

    flagged = llama3_style_folder(tmp_path / "flagged", add_bos_token=False, add_eos_token=True)
    bare = llama3_style_folder(tmp_path / "bare", add_bos_token=True)
    data = json.loads((bare / "tokenizer.json").read_text())
    data["post_processor"] = None
    (bare / "tokenizer.json").write_text(json.dumps(data))
    for folder in (flagged, bare):
        ours, oracle = Tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
        for text in TEXTS[:3]:
            assert ours.encode(text) == oracle.encode(text), folder.name
    bos = Tokenizer(flagged).encode("<|begin_of_text|>", add_special_tokens=False)
    assert Tokenizer(flagged).encode("hi")[:1] == bos and bos[0] not in Tokenizer(bare).encode("hi")


def test_slow_only_folder_falls_back_to_transformers(tmp_path, capfd):
    """vocab.json + merges.txt and no tokenizer.json: converted by transformers, with a message naming the fix."""
    from transformers import AutoTokenizer

    fast = llama3_style_folder(tmp_path / "fast")
    slow = tmp_path / "slow"
    slow.mkdir()
    from tokenizers import Tokenizer as RustTokenizer

    RustTokenizer.from_file(str(fast / "tokenizer.json")).model.save(str(slow))
    (slow / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>", "add_bos_token": True}))
    ours = Tokenizer(slow)
    assert "has no tokenizer.json" in capfd.readouterr().err
    oracle = AutoTokenizer.from_pretrained(str(slow))
    assert ours.vocab_size == len(oracle)
    for text in TEXTS:
        assert ours.encode(text) == oracle.encode(text), text
        assert ours.decode(oracle.encode(text), False) == oracle.decode(oracle.encode(text)), text


def test_missing_or_broken_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load the tokenizer"):
        Tokenizer(tmp_path)


@pytest.fixture(scope="module", params=["smollm2", "sentencepiece"])
def tokenizer(request, tmp_path_factory):
    """(lmkit's Tokenizer, the oracle) for the streaming tests: a byte-level BPE and a SentencePiece-style one."""
    from transformers import AutoTokenizer

    if request.param == "smollm2":
        folder = request.getfixturevalue("smollm2_path")
    else:
        folder = sentencepiece_style_folder(tmp_path_factory.mktemp("sp-tokenizer"))
    return Tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))


def stream(tokenizer: Tokenizer, ids: list[int], skip: bool) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, skip)
    deltas = [detok.add([t]) for t in ids]
    deltas.append(detok.add([], final=True))
    assert "".join(deltas) == detok.text
    return deltas


@pytest.mark.parametrize("skip", [True, False])
def test_deltas_join_to_the_full_decode(tokenizer, skip):
    ours, oracle = tokenizer
    rng = random.Random(0)
    specials = oracle.all_special_ids
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        for _ in range(3):  # special tokens dropped in at random places
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        expected = oracle.decode(ids, skip_special_tokens=skip)
        deltas = stream(ours, ids, skip)
        assert "".join(deltas) == expected, (text, deltas)
        assert not any(d.endswith("\ufffd") for d in deltas[:-1]), deltas  # no character sent in halves


def test_random_ids_join_to_the_full_decode(tokenizer):
    """Arbitrary id sequences (broken UTF-8 included): the joined deltas still equal the full decode."""
    ours, oracle = tokenizer
    rng = random.Random(1)
    n = ours.vocab_size
    for _ in range(20):
        ids = [rng.randrange(n) for _ in range(rng.randint(1, 60))]
        assert "".join(stream(ours, ids, True)) == oracle.decode(ids, skip_special_tokens=True)
