"""Structured output in the engine: llguidance's token masks applied by the sampler (csrc/engine/grammar.h).

Oracles: an independent brute force for regexes and choices (a token is allowed iff the text with it is still a
prefix of a match, the `regex` module's partial matching), llguidance's own Python matcher for JSON schemas
(its masks, with the tokenizer's canonical tokenization, are a subset of ours: we do not force canonical
tokens), `jsonschema` for every finished answer, and the returned logits for what greedy and logprobs saw.
"""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

from lmkit import GenerationConfig, StructuredOutput, StructuredOutputError

jsonschema = pytest.importorskip("jsonschema")
llguidance = pytest.importorskip("llguidance")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "address": {"type": "object", "properties": {"street": {"type": "string", "maxLength": 30},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "city", "address"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON: name, age, city, tags and address."}]


def _mask_of(matcher, vocab: int) -> np.ndarray:
    return np.asarray(matcher.mask(vocab))


def _brute_force_mask(pipe, prefix: bytes, full_match, vocab: int) -> np.ndarray:
    """Token t allowed iff prefix + bytes(t) is ASCII and still a prefix of a match; eos iff prefix matches."""
    tok = pipe.tokenizer
    eos = set(pipe.engine.spec.eos_token_ids)
    allowed = np.zeros(vocab, dtype=bool)
    for t in range(vocab):
        if t in eos:
            allowed[t] = full_match(prefix, partial=False)
            continue
        if t >= tok.vocab_size:
            continue
        piece = tok.token_bytes(t)
        if not piece or tok.decode([t], skip_special_tokens=True) == "" and piece.startswith(b"<"):
            continue  # special tokens are never part of the text
        text = prefix + piece
        allowed[t] = text.isascii() and full_match(text, partial=True)
    return allowed


@pytest.mark.parametrize("constraint, pattern", [
    (StructuredOutput(regex=r"[a-c]{2}-[0-9]{1,3}"), r"[a-c]{2}-[0-9]{1,3}"),
    (StructuredOutput(choice=["yes", "no way", "maybe"]), r"yes|no way|maybe"),
    (StructuredOutput(choice=["no", "no way", "nope", "maybe"]), r"no|no way|nope|maybe"),  # prefixes of others
])
def test_masks_equal_brute_force(smollm2_pipe, constraint, pattern):
    import regex

    compiled_re = regex.compile(pattern)

    def full_match(text: bytes, partial: bool) -> bool:
        return compiled_re.fullmatch(text.decode("ascii"), partial=partial) is not None

    vocab = smollm2_pipe.engine.spec.vocab_size
    matcher = smollm2_pipe.engine.compile_grammar(constraint).matcher()
    rng = np.random.default_rng(7)
    prefix = b""
    for _ in range(8):
        ours = _mask_of(matcher, vocab)
        expected = _brute_force_mask(smollm2_pipe, prefix, full_match, vocab)
        diff = np.flatnonzero(ours != expected)
        assert diff.size == 0, [(int(t), smollm2_pipe.tokenizer.token_bytes(int(t)), bool(ours[t])) for t in diff[:8]]
        choices = [t for t in np.flatnonzero(ours) if t not in smollm2_pipe.engine.spec.eos_token_ids]
        if not choices:
            break
        t = int(rng.choice(choices))
        assert matcher.consume(t)
        prefix += smollm2_pipe.tokenizer.token_bytes(t)
    assert matcher.is_accepting() or not matcher.is_stopped()


def test_json_masks_hold_llguidance_python_masks(smollm2_pipe, smollm2_path):
    """Every token llguidance's own matcher allows (canonical tokenization) is allowed by ours; the walk ends
    in a document that validates."""
    from llguidance import LLMatcher, LLTokenizer

    spec = smollm2_pipe.engine.spec
    vocab = spec.vocab_size
    reference = LLMatcher(LLTokenizer(smollm2_pipe.tokenizer.to_json(), n_vocab=vocab, eos_token=spec.eos_token_ids),
                          LLMatcher.grammar_from_json_schema(PERSON, defaults={"whitespace_flexible": False,
                                                                               "item_separator": ", ",
                                                                               "key_separator": ": "}))
    ours = smollm2_pipe.engine.compile_grammar(StructuredOutput(json=PERSON)).matcher()
    rng = np.random.default_rng(3)
    out: list[int] = []
    for _ in range(400):
        theirs = np.unpackbits(np.frombuffer(reference.compute_bitmask(), dtype=np.uint8),
                               bitorder="little")[:vocab].astype(bool)
        mine = _mask_of(ours, vocab)
        assert not (theirs & ~mine).any(), np.flatnonzero(theirs & ~mine)[:8]
        t = int(rng.choice(np.flatnonzero(theirs)))  # a path both allow
        if t in spec.eos_token_ids:
            break
        assert ours.consume(t) and reference.consume_token(t)
        out.append(t)
        if ours.is_stopped():
            break
    assert ours.is_accepting()
    jsonschema.validate(json.loads(smollm2_pipe.tokenizer.decode(out)), PERSON)


def test_greedy_and_logprobs_see_the_masked_distribution(smollm2_pipe):
    """Each greedy token is the argmax of the returned logits over the grammar's mask, and its logprob is the
    log-softmax over the allowed tokens (replayed with an independent matcher of the same grammar)."""
    constraint = StructuredOutput(json=PERSON)
    r = smollm2_pipe(ASK, GenerationConfig(max_new_tokens=120, structured_output=constraint, output_logits=True,
                                           logprobs=2))
    assert r.finish_reason == "stop", r.text
    jsonschema.validate(json.loads(r.text), PERSON)
    vocab = smollm2_pipe.engine.spec.vocab_size
    matcher = smollm2_pipe.engine.compile_grammar(constraint).matcher()
    num_prompt = len(smollm2_pipe.encode(ASK))
    logits = r.logits[num_prompt - 1:]  # the row of each position from the prompt's last: each output token's
    for i, t in enumerate(r.token_ids):
        mask = _mask_of(matcher, vocab)
        row = np.where(mask, logits[i].astype(np.float64), -np.inf)
        assert t == int(np.argmax(row)), i
        log_z = row.max() + math.log(np.exp(row[mask] - row.max()).sum())
        assert abs(r.logprobs[i][t] - (row[t] - log_z)) < 1e-3
        assert matcher.consume(t)
    assert matcher.is_accepting()


@pytest.mark.slow
def test_sampled_answers_validate_and_free_rows_are_unchanged(smollm2_pipe):
    """Constrained and free rows in one batch: every constrained sample (temperature 1) validates; a free greedy
    row beside them gives the text it gives alone."""
    from lmkit import AsyncEngine

    free = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    alone = smollm2_pipe(ASK, free).text
    constrained = GenerationConfig(max_new_tokens=160, do_sample=True, temperature=1.0, random_seed=11,
                                   structured_output=StructuredOutput(json=PERSON), n=4)
    engine = AsyncEngine(engine=smollm2_pipe.engine)

    async def run():
        async def text_of(gen):
            parts: dict[int, list[str]] = {}
            finish: dict[int, str] = {}
            async for r in engine.generate(ASK, gen):
                parts.setdefault(r.sample_index, []).append(r.text)
                if r.finish_reason:
                    finish[r.sample_index] = r.finish_reason
            return {k: ("".join(v), finish[k]) for k, v in parts.items()}
        return await asyncio.gather(text_of(constrained), text_of(free), text_of(constrained))

    first, plain, second = asyncio.run(run())
    assert plain[0][0] == alone
    for answers in (first, second):
        assert len(answers) == 4
        for text, finish in answers.values():
            assert finish == "stop", text
            jsonschema.validate(json.loads(text), PERSON)
    smollm2_pipe.engine.check_integrity()


def test_a_choice_that_is_a_prefix_of_another_may_end_or_go_on(smollm2_pipe):
    matcher = smollm2_pipe.engine.compile_grammar(StructuredOutput(choice=["no", "no way"])).matcher()
    for t in smollm2_pipe.tokenizer.encode("no", add_special_tokens=False):
        assert matcher.consume(t)
    assert matcher.is_accepting() and not matcher.is_stopped()


def test_many_choices_generate_one_of_them(smollm2_pipe):
    """5,000 choices (as rule alternatives, 5,001 items in the parser's first row: llguidance refused the first
    token past 2,000, a 500)."""
    rng = np.random.default_rng(3)
    choices = [f"item-{int(rng.integers(10**9))}-{i}" for i in range(5000)]
    r = smollm2_pipe(ASK, GenerationConfig(max_new_tokens=24, structured_output=StructuredOutput(choice=choices)))
    assert r.error is None and r.finish_reason == "stop" and r.text in choices, (r.error, r.text)


def test_constraint_after_a_token(smollm2_pipe):
    """structured_output_after_token: free text until that token, the grammar after it (reasoning's end)."""
    free = smollm2_pipe(ASK, GenerationConfig(max_new_tokens=3, ignore_eos=True))
    trigger = free.token_ids[0]
    r = smollm2_pipe(ASK, GenerationConfig(max_new_tokens=40, structured_output=StructuredOutput(choice=["Yes", "No"]),
                                           structured_output_after_token=trigger))
    assert r.token_ids[0] == trigger and r.finish_reason == "stop"
    assert smollm2_pipe.tokenizer.decode(r.token_ids[1:]) in ("Yes", "No")


def test_cached_compile_and_bad_constraints(smollm2_pipe):
    engine = smollm2_pipe.engine
    a = engine.compile_grammar(StructuredOutput(json=PERSON))
    before = engine.grammars.num_compiled
    assert engine.compile_grammar(StructuredOutput(json=json.dumps(PERSON))) is a  # same text: cached
    assert engine.grammars.num_compiled == before
    for bad, words in [(StructuredOutput(regex="(unclosed"), "regex"),
                       (StructuredOutput(json={"type": "bogus"}), "json_schema"),
                       (StructuredOutput(json={"type": "string", "format": "no-such-format"}), "format"),
                       (StructuredOutput(grammar="start: undefined_rule"), "lark")]:
        with pytest.raises(StructuredOutputError, match=words) as first:
            engine.compile_grammar(bad)
        compiled = engine.grammars.num_compiled
        with pytest.raises(StructuredOutputError) as again:  # a refusal is kept too: no second compile
            engine.compile_grammar(bad)
        assert str(again.value) == str(first.value) and engine.grammars.num_compiled == compiled
        assert "\n" not in str(first.value) and len(str(first.value)) <= 300  # no parser state dump
    with pytest.raises(StructuredOutputError, match="exactly one"):
        StructuredOutput(regex="a", choice=["b"])
    with pytest.raises(StructuredOutputError, match="non-empty"):
        StructuredOutput(choice=[])
    r = smollm2_pipe("hi", GenerationConfig(max_new_tokens=8, structured_output=StructuredOutput(choice=["ok"])))
    assert (r.text, r.finish_reason) == ("ok", "stop")


def test_a_schema_past_the_size_bound_is_refused_before_compiling(smollm2_pipe):
    """MAX_SCHEMA_NODES values (the root, the enum list and its items here) compile; one more is refused naming
    the bound, before llguidance sees it, and a string schema is counted like a dict."""
    from lmkit.structured import MAX_SCHEMA_NODES

    engine = smollm2_pipe.engine
    at_bound = {"enum": list(range(MAX_SCHEMA_NODES - 2))}
    engine.compile_grammar(StructuredOutput(json=at_bound))
    compiled = engine.grammars.num_compiled
    for past in ({"enum": list(range(MAX_SCHEMA_NODES - 1))}, json.dumps({"enum": list(range(MAX_SCHEMA_NODES))})):
        with pytest.raises(StructuredOutputError, match=f"more than {MAX_SCHEMA_NODES:,} values"):
            engine.compile_grammar(StructuredOutput(json=past))
    assert engine.grammars.num_compiled == compiled


def _rule_chain(rules: int, groups: int) -> str:
    """Lark whose rules each hold the next inside ``groups`` nested parentheses: llguidance recurses once per link."""
    import itertools
    import string

    names = ["".join(p) for n in (1, 2, 3, 4) for p in itertools.product(string.ascii_lowercase, repeat=n)]
    return "start:a\n" + "".join(f"{names[i]}:{'(' * groups}{names[i + 1]}{')' * groups}\n" for i in range(rules)) + \
        f'{names[rules]}:"end"'


def test_the_deepest_grammar_within_the_size_bound_compiles_and_generates(smollm2_pipe):
    """A chain of rules is compiled by recursion in llguidance: 3,000 links overflowed the calling thread's 8 MiB
    stack and killed the process (SIGSEGV). The compile runs on a thread of its own with a deep stack: the
    deepest grammar found within MAX_GRAMMAR_CHARS (its links 20 groups deep) compiles here, on the calling
    thread, and constrains a generation; one character more of it is refused before compiling."""
    from lmkit.structured import MAX_GRAMMAR_CHARS

    engine = smollm2_pipe.engine
    deep = _rule_chain(5491, 20)
    assert MAX_GRAMMAR_CHARS - 48 < len(deep) <= MAX_GRAMMAR_CHARS  # one rule more would not fit
    r = smollm2_pipe("hi", GenerationConfig(max_new_tokens=8, structured_output=StructuredOutput(grammar=deep)))
    assert (r.text, r.finish_reason) == ("end", "stop")
    compiled = engine.grammars.num_compiled
    with pytest.raises(StructuredOutputError, match=f"more than the {MAX_GRAMMAR_CHARS:,} allowed"):
        engine.compile_grammar(StructuredOutput(grammar=deep + " " * (MAX_GRAMMAR_CHARS + 1 - len(deep))))
    assert engine.grammars.num_compiled == compiled


def test_grammar_and_regex_sizes_are_bounded_before_compiling(smollm2_pipe):
    """A regex or a grammar past MAX_GRAMMAR_CHARS (GBNF before its conversion too) is refused naming the bound;
    a grammar's %json schemas do not count toward it but each is held to MAX_SCHEMA_NODES."""
    from lmkit.structured import MAX_GRAMMAR_CHARS, MAX_SCHEMA_NODES

    engine = smollm2_pipe.engine
    compiled = engine.grammars.num_compiled
    long_words = [f"{i:06d}" * 8 for i in range(6000)]  # 6,001 values, ~330 KB of JSON
    schema = json.dumps({"enum": long_words})
    assert len(schema) > MAX_GRAMMAR_CHARS
    engine.compile_grammar(StructuredOutput(grammar=f"start: %json {schema}"))
    assert engine.grammars.num_compiled == compiled + 1
    too_many = json.dumps({"enum": list(range(MAX_SCHEMA_NODES))})
    refusals = [
        (dict(regex="a" * (MAX_GRAMMAR_CHARS + 1)), "regex has 262,145 characters"),
        (dict(grammar='start: "' + "a" * MAX_GRAMMAR_CHARS + '"'), "grammar has 262,153 characters,"),
        (dict(grammar='root ::= "' + "a" * MAX_GRAMMAR_CHARS + '"'), "grammar has 262,155 characters,"),
        (dict(grammar=f"start: %json {too_many}"), f"more than {MAX_SCHEMA_NODES:,} values"),
        (dict(grammar=f'start: %json {schema} | "' + "b" * MAX_GRAMMAR_CHARS + '"'),
         "characters outside its %json schemas"),
    ]
    for fields, words in refusals:
        with pytest.raises(StructuredOutputError, match=words):
            engine.compile_grammar(StructuredOutput(**fields))
    assert engine.grammars.num_compiled == compiled + 1


def test_a_compile_past_its_deadline_is_refused_and_runs_alone(smollm2_pipe):
    """A compile that takes longer than compile_timeout_s is refused at the deadline (llguidance cannot be
    stopped: it ends on its thread), the refusal is cached, and the next compile waits for the overdue one, so
    one runs at a time; dropping the cache joins what still runs."""
    import gc
    import time

    from lmkit.structured import GrammarCache

    e = smollm2_pipe.engine
    cache = GrammarCache(e.tokenizer.to_json(), e.spec.vocab_size, e.spec.eos_token_ids, compile_timeout_s=0.02)
    cache.compile(StructuredOutput(regex="[ab]"))  # the vocabulary, outside the deadline's test
    slow = StructuredOutput(grammar=_rule_chain(14_000, 5))  # ~0.4-1 s to compile
    started = time.perf_counter()
    with pytest.raises(StructuredOutputError, match="took longer than 0.02 s: make it smaller or simpler"):
        cache.compile(slow)
    assert time.perf_counter() - started < 0.3
    with pytest.raises(StructuredOutputError, match="took longer"):  # cached: no second compile
        cache.compile(slow)
    assert cache.num_compiled == 2
    assert cache.compile(StructuredOutput(regex="[cd]")) is not None  # after the overdue one ends
    with pytest.raises(StructuredOutputError, match="took longer"):
        cache.compile(StructuredOutput(grammar=_rule_chain(13_999, 5)))
    del cache
    gc.collect()  # joins the overdue compile before its vocabulary is freed (a crash here otherwise)
    r = smollm2_pipe("hi", GenerationConfig(max_new_tokens=4, structured_output=StructuredOutput(choice=["ok"])))
    assert r.text == "ok"


def test_choice_grammar_lists_each_choice_as_itself():
    """The choices' Lark alternation (built from one json.dumps of the list): exactly one JSON string literal per
    choice, in order, whatever the choices hold (quotes, '", "' itself, backslashes, newlines, non-ASCII)."""
    import json

    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=200, deadline=None, derandomize=True, database=None)
    @given(st.lists(st.one_of(st.text(max_size=12), st.sampled_from(['", "', '"', '\\', '\\", \\"', ' | ', 'é"\n'])),
                    min_size=1, max_size=8))
    def check(choices):
        kind, text = StructuredOutput(choice=choices).source()
        assert kind == "lark" and text.startswith("start: CHOICE\nCHOICE: ")
        assert text == "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)

    check()
