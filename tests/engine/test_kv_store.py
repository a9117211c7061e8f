"""The KV disk store (EngineConfig.kv_cache_dir): prefix blocks evicted from the pool are written to a directory and
read back instead of recomputed, with greedy output identical to a cold run (fp32, bf16, int8, int4 KV; a sliding
window model; a mixture of experts), also after a restart; corrupt, truncated and foreign files are ignored and
counted; several processes share one directory; a full disk degrades to fewer hits; the size cap holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from lmkit import EngineConfig, GenerationConfig, pipeline

ROOT = Path(__file__).resolve().parents[2]
GEN = GenerationConfig(max_new_tokens=12, ignore_eos=True)
# 24 blocks of 16 tokens: a 200-token document fills half the pool, three other prompts evict it
BASE = dict(device="cpu", dtype="float32", cache_max_entry_count=24, cache_block_seq_len=16, max_batch_size=4,
            session_len=512)


def prompts(seed: int = 0) -> tuple[list[int], list[list[int]]]:
    """A long document (its second turn: the document and a question) and three unrelated prompts that evict it."""
    rng = np.random.default_rng(seed)
    doc = rng.integers(0, 256, size=200).tolist()
    return doc, [rng.integers(0, 256, size=150).tolist() for _ in range(3)]


def cold(folder, prompt: list[int], gen: GenerationConfig = GEN, **config) -> list[int]:
    with pipeline(folder, EngineConfig(**{**BASE, **config})) as pipe:
        return pipe(prompt, gen).token_ids


def evict_and_return(folder, store: Path, **config):
    """Runs the document, evicts it with other prompts, runs its second turn; then restarts the engine and runs the
    second turn again. Returns (first, second turn, after restart, metrics before and after the restart)."""
    doc, others = prompts()
    turn2 = doc + [7, 8, 9]
    with pipeline(folder, EngineConfig(**{**BASE, **config}, enable_prefix_caching=True, kv_cache_dir=str(store))) as p:
        first = p(doc, GEN).token_ids
        for other in others:
            p(other, GEN)
        p.engine.flush_kv_store()  # the writer is asynchronous: the evicted blocks are on disk from here
        second = p(turn2, GEN).token_ids
        m1 = p.engine.metrics()
    with pipeline(folder, EngineConfig(**{**BASE, **config}, enable_prefix_caching=True, kv_cache_dir=str(store))) as p:
        restarted = p(turn2, GEN).token_ids
        m2 = p.engine.metrics()
        p.engine.check_integrity()
    return first, second, restarted, m1, m2


def kv_configs():
    from lmkit._ext import _engine

    bf16 = pytest.mark.skipif(not _engine.cpu_bf16_available(), reason="bf16 KV needs a CPU with AVX512_BF16")
    # auto: bf16 compute and KV where the CPU has AVX512_BF16, else float32 compute over a bf16 KV cache
    return [pytest.param(dict(dtype="float32"), id="fp32"), pytest.param(dict(), id="auto"),
            pytest.param(dict(dtype="bfloat16"), id="bf16", marks=bf16),
            pytest.param(dict(quant_policy=8), id="int8"), pytest.param(dict(quant_policy=4), id="int4")]


@pytest.mark.parametrize("kv", kv_configs())
def test_blocks_read_back_give_the_cold_run_tokens(tiny_llama, tmp_path, kv):
    folder, _ = tiny_llama
    doc, _ = prompts()
    first, second, restarted, m1, m2 = evict_and_return(folder, tmp_path / "store", **kv)
    assert first == cold(folder, doc, **kv)
    assert second == restarted == cold(folder, doc + [7, 8, 9], **kv)
    # the second turn found the document's 12 full blocks on disk (the pool had lost them), and after the restart too
    assert m1.num_store_hit_tokens == 12 * 16 and m1.num_store_dropped_blocks == 0, m1
    assert m2.num_store_hit_tokens == 12 * 16 and m2.num_prefix_hit_tokens == 12 * 16, m2
    assert m2.num_store_read_blocks == 12 and m2.num_store_ignored_files == 0
    assert m1.num_store_written_blocks > 0 and m1.has_kv_store


@pytest.mark.parametrize("read_mib", [1e-6, 0])
def test_a_long_read_goes_a_share_a_step_while_others_run(tiny_llama, tmp_path, read_mib):
    """The document's 12 blocks on disk, a fresh pool, and another request running beside the second turn: with a
    read cap of one block a step (1e-6 MiB rounds up to a block) the turn reads its prefix over many steps, the
    other request's steps going on; uncapped, all at once. Either way the tokens are a cold run's and every block
    read is a hit."""
    folder, _ = tiny_llama
    doc, _ = prompts()
    turn2, fresh = doc + [7, 8, 9], prompts(seed=1)[1][0]  # fresh: none of its blocks on disk
    # `beside` may decode 870 steps (up to the model's 1,024 positions) and is cancelled once the turn has ended, so
    # it runs throughout the turn's read (12 steps) unless the turn arrives 870 steps late. A tiny model's step takes
    # a fraction of a millisecond: a fresh-clone run once read all 12 blocks in one lookup, most likely because the
    # turn (then submitted through a pipeline) arrived after a `beside` of 290 steps had ended.
    gen, gen_beside = (GenerationConfig(max_new_tokens=n, ignore_eos=True) for n in (8, 870))
    room = dict(cache_max_entry_count=96, session_len=1024)  # both at once
    store = tmp_path / "store"
    evict_and_return(folder, store)  # the document's blocks are on disk
    config = EngineConfig(**{**BASE, **room}, enable_prefix_caching=True, kv_cache_dir=str(store),
                          kv_cache_read_mib_per_step=read_mib)
    with pipeline(folder, config) as p:
        (beside_id, beside_q), (_, turn_q) = (p.engine.submit_to_queue(ids, g) for ids, g in
                                              ((fresh, gen_beside), (turn2, gen)))

        def drain(q) -> tuple[list[int], str, str]:
            """A completion's tokens, finish reason and error, from its outputs up to the final one."""
            tokens = []
            while True:
                o = q.get(timeout=120)
                tokens.extend(o.token_ids)
                if o.finished:
                    return tokens, o.finish_reason, o.error

        second, *end = drain(turn_q)
        assert end == ["length", ""]
        p.engine.cancel(beside_id)
        beside, *end = drain(beside_q)
        assert end == ["cancelled", ""]  # it ran throughout the turn
        m = p.engine.metrics()
        p.engine.check_integrity()
    assert second == cold(folder, turn2, gen, **room)
    assert 0 < len(beside) < 870 and beside == cold(folder, fresh, gen_beside, **room)[:len(beside)]
    assert m.num_store_hit_tokens == 12 * 16 and m.num_prefix_hit_tokens == 12 * 16, m
    # lookups that found blocks: one a step while capped (`beside`'s own lookup found none)
    assert m.num_store_read_blocks == 12 and m.num_store_missed_lookups == 1, m
    assert m.num_store_lookups - m.num_store_missed_lookups == (12 if read_mib else 1), m


@pytest.mark.parametrize("case", ["mistral-sliding-window", "moe"])
def test_windowed_and_moe_models(tmp_path, case):
    from tests.factories import make_moe_model, make_tiny_model

    folder = tmp_path / "model"
    if case == "moe":
        make_moe_model(folder, "Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                      intermediate_size=128))
    else:
        make_tiny_model(folder, "mistral", sliding_window=24, num_key_value_heads=1)
    doc, _ = prompts()
    first, second, restarted, m1, m2 = evict_and_return(folder, tmp_path / "store")
    assert first == cold(folder, doc)
    assert second == restarted == cold(folder, doc + [7, 8, 9])
    assert m2.num_store_hit_tokens == 12 * 16, m2
    if case != "moe":  # a window of 24 reads 2 blocks back: only those are read, the rest confirmed by their header
        assert m2.num_store_read_blocks == 2, m2


def block_file(store: Path, tokens: list[int], identity: str = "") -> Path:
    """The store file (of an identity: its name's first half) holding the block of these tokens (the 16 token ids
    after its 64-byte header)."""
    want = np.asarray(tokens, dtype="<i4").tobytes()
    found = [p for p in store.glob(f"{identity}*.kvb") if p.read_bytes()[64:64 + len(want)] == want]
    assert found, f"no block of {tokens[:4]}... in {store}"
    return found[0]


def test_corrupt_truncated_and_foreign_files_are_ignored_counted_and_never_served(tiny_llama, tmp_path):
    folder, _ = tiny_llama
    store = tmp_path / "store"
    doc, _ = prompts()
    turn2 = doc + [7, 8, 9]
    expected = cold(folder, turn2)
    config = EngineConfig(**BASE, enable_prefix_caching=True, kv_cache_dir=str(store))
    with pipeline(folder, config) as pipe:
        pipe(doc, GEN)
    # the document's block 3 gets a flipped K/V byte, block 6 is truncated, block 9 names another identity
    flipped, truncated, foreign = (block_file(store, doc[16 * b:16 * (b + 1)]) for b in (3, 6, 9))
    bad = bytearray(flipped.read_bytes())
    bad[-100] ^= 0xFF
    flipped.write_bytes(bytes(bad))
    truncated.write_bytes(truncated.read_bytes()[:-7])
    other_identity = bytearray(foreign.read_bytes())
    other_identity[16] ^= 0x01  # the identity field (the header checksum then fails too)
    foreign.write_bytes(bytes(other_identity))
    hits = []
    for _ in range(4):  # each run reads the chain up to its first bad block, which it removes; then rewrites it
        with pipeline(folder, config) as pipe:
            assert pipe(turn2, GEN).token_ids == expected
            m = pipe.engine.metrics()
        hits.append((m.num_store_hit_tokens, m.num_store_ignored_files))
    assert hits == [(3 * 16, 1), (6 * 16, 1), (9 * 16, 1), (12 * 16, 0)], hits


def test_another_model_never_reads_the_files(tmp_path):
    from tests.factories import make_tiny_model

    a, b = tmp_path / "a", tmp_path / "b"
    make_tiny_model(a, "llama", seed=0)
    make_tiny_model(b, "llama", seed=1)  # same shapes and tokenizer, other weights
    store = tmp_path / "store"
    doc, _ = prompts()
    with pipeline(a, EngineConfig(**BASE, enable_prefix_caching=True, kv_cache_dir=str(store))) as pipe:
        pipe(doc, GEN)
    written = {p.name for p in store.glob("*.kvb")}
    with pipeline(b, EngineConfig(**BASE, enable_prefix_caching=True, kv_cache_dir=str(store))) as pipe:
        got = pipe(doc + [7, 8, 9], GEN).token_ids
        m = pipe.engine.metrics()
    assert got == cold(b, doc + [7, 8, 9])
    assert m.num_store_hit_tokens == 0 and m.num_store_missed_lookups == 1, m
    assert written <= {p.name for p in store.glob("*.kvb")}  # model a's files stay, b's are beside them
    # model b's file renamed to model a's name: a reads its header, sees the foreign identity, ignores it
    # a's first block of the document; b's has the same key (the name's second half) and another identity
    (mine,) = [p for p in store.glob("*.kvb") if p.name in written and p == block_file(store, doc[:16], p.name[:16])]
    (theirs,) = [p for p in store.glob("*.kvb") if p.name not in written and p.name[17:] == mine.name[17:]]
    os.replace(theirs, mine)
    with pipeline(a, EngineConfig(**BASE, enable_prefix_caching=True, kv_cache_dir=str(store))) as pipe:
        assert pipe(doc + [7, 8, 9], GEN).token_ids == cold(a, doc + [7, 8, 9])
        assert pipe.engine.metrics().num_store_ignored_files >= 1


def test_an_idle_engine_writes_its_cached_blocks(tiny_llama, tmp_path):
    """Nothing evicted, no shutdown: after a second of idleness the pool's cached blocks are on disk anyway (a server
    killed later still leaves them)."""
    import time

    folder, _ = tiny_llama
    store = tmp_path / "store"
    doc, _ = prompts()
    with pipeline(folder, EngineConfig(**BASE, enable_prefix_caching=True, kv_cache_dir=str(store))) as pipe:
        pipe(doc, GEN)
        assert pipe.engine.metrics().num_store_written_blocks == 0  # the pool holds everything: nothing evicted
        deadline = time.monotonic() + 10
        while pipe.engine.metrics().num_store_written_blocks < 13 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pipe.engine.metrics().num_store_written_blocks == 13  # the document's 12 blocks and 1 of its answer
    assert len(list(store.glob("*.kvb"))) == 13


def test_kv_settings_are_part_of_the_identity(tiny_llama, tmp_path):
    """Blocks written with float32 K/V are never read by an int8-KV engine (or a bf16 one, or one whose weights are
    rounded to int8 at load) on the same directory."""
    folder, _ = tiny_llama
    store = tmp_path / "store"
    doc, _ = prompts()
    turn2 = doc + [7, 8, 9]
    with pipeline(folder, EngineConfig(**BASE, enable_prefix_caching=True, kv_cache_dir=str(store))) as pipe:
        pipe(doc, GEN)
    for other in (dict(quant_policy=8), dict(quant_policy=8, cache_block_seq_len=32), dict(quantization="int8")):
        with pipeline(folder, EngineConfig(**{**BASE, **other}, enable_prefix_caching=True,
                                           kv_cache_dir=str(store))) as pipe:
            assert pipe(turn2, GEN).token_ids == cold(folder, turn2, **other)
            m = pipe.engine.metrics()
        assert m.num_store_hit_tokens == 0 and m.num_store_ignored_files == 0, (other, m)


_WORKER = textwrap.dedent("""
    import json, resource, signal, sys
    from lmkit import EngineConfig, GenerationConfig, pipeline
    folder, store, prompts, fsize = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    if fsize:  # a disk that takes no more than fsize bytes per file: writes fail with EFBIG, as when full
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    config = EngineConfig(**json.loads(sys.argv[5]), enable_prefix_caching=True, kv_cache_dir=store)
    with pipeline(folder, config) as pipe:
        out = [pipe(p, GenerationConfig(max_new_tokens=12, ignore_eos=True)).token_ids for p in prompts]
        pipe.engine.flush_kv_store()
        m = pipe.engine.metrics()
    print(json.dumps(dict(out=out, hits=m.num_store_hit_tokens, errors=m.num_store_write_errors,
                          written=m.num_store_written_blocks, ignored=m.num_store_ignored_files)))
""")


def run_workers(folder, store, prompt_lists, fsize: int = 0) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(folder), str(store), json.dumps(p), str(fsize),
                               json.dumps(BASE)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for p in prompt_lists]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_processes_share_one_directory(tiny_llama, tmp_path):
    folder, _ = tiny_llama
    store = tmp_path / "store"
    doc, others = prompts()
    turn2 = doc + [7, 8, 9]
    expected = [cold(folder, p) for p in (doc, *others, turn2)]
    # two writers of the same blocks and a reader racing them, at once
    results = run_workers(folder, store, [[doc, *others, turn2], [doc, *others, turn2], [turn2, turn2]])
    for r in results[:2]:
        assert r["out"] == expected and r["ignored"] == 0, r
    assert results[2]["out"] == [expected[-1]] * 2 and results[2]["ignored"] == 0
    # afterwards a fresh process finds the document on disk
    (after,) = run_workers(folder, store, [[turn2]])
    assert after["out"] == [expected[-1]] and after["hits"] == 12 * 16, after


def test_a_full_disk_degrades_to_no_store(tiny_llama, tmp_path):
    folder, _ = tiny_llama
    doc, others = prompts()
    turn2 = doc + [7, 8, 9]
    (r,) = run_workers(folder, tmp_path / "store", [[doc, *others, turn2]], fsize=1000)
    assert r["out"] == [cold(folder, p) for p in (doc, *others, turn2)]
    assert r["errors"] >= 1 and r["written"] == 0 and r["hits"] == 0, r


def test_the_size_cap_holds(tiny_llama, tmp_path):
    folder, _ = tiny_llama
    store = tmp_path / "store"
    doc, others = prompts()
    with pipeline(folder, EngineConfig(**BASE, enable_prefix_caching=True, kv_cache_dir=str(store),
                                       kv_cache_disk_gib=100_000 / 2**30)) as pipe:
        block_file = pipe.engine.kv_bytes_per_block + 64 + 16 * 4
        for p in (doc, *others):
            pipe(p, GEN)
        pipe.engine.flush_kv_store()
        m = pipe.engine.metrics()
    assert m.num_store_evicted_files > 0 and m.num_store_written_blocks * block_file > 100_000, m
    assert sum(p.stat().st_size for p in store.glob("*.kvb")) <= 100_000


def test_metrics_are_exported(tiny_llama, tmp_path):
    from lmkit.serve.metrics import _EngineCollector

    folder, _ = tiny_llama
    doc, _ = prompts()
    with pipeline(folder, EngineConfig(**BASE, enable_prefix_caching=True, kv_cache_dir=str(tmp_path / "s"))) as pipe:
        pipe(doc, GEN)
        names = {family.name for family in _EngineCollector(pipe.engine).collect()}
    assert {"lmkit_kv_store_hit_rate", "lmkit_prefix_cache_hit_rate", "lmkit_kv_store_hits_tokens",
            "lmkit_kv_store_written_blocks", "lmkit_kv_store_ignored_files", "lmkit_kv_store_dropped_blocks"} <= names


@pytest.mark.parametrize("kwargs, match", [
    (dict(kv_cache_dir="/tmp/x"), "needs enable_prefix_caching=True"),
    (dict(kv_cache_dir="/tmp/x", enable_prefix_caching=True, device="cuda"), "runs on the CPU backend"),
    (dict(kv_cache_dir="/tmp/x", enable_prefix_caching=True, kv_cache_disk_gib=0), "kv_cache_disk_gib must be"),
    (dict(kv_cache_dir="", enable_prefix_caching=True), "kv_cache_dir must be a directory path"),
    (dict(kv_cache_read_mib_per_step=-1), "kv_cache_read_mib_per_step must be a number >= 0"),
])
def test_bad_settings_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_an_unusable_directory_or_a_recurrent_model_is_refused(tiny_llama, tmp_path):
    from tests.factories import build_case

    folder, _ = tiny_llama
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        pipeline(folder, EngineConfig(**BASE, enable_prefix_caching=True, kv_cache_dir=str(not_a_dir)))
    hybrid = tmp_path / "qwen3_5"
    build_case("qwen3_5", hybrid)
    with pytest.raises(ValueError, match="recurrent layers are not supported by the disk store"):
        pipeline(hybrid, EngineConfig(**BASE, enable_prefix_caching=True, kv_cache_dir=str(tmp_path / "s")))


def test_the_serve_flags_reach_the_config(tmp_path):
    from lmkit.serve.cli import engine_config

    c = engine_config("cpu", 4, None, 64, None, 8192, 0, None, True, None, kv_cache_dir=tmp_path / "s",
                      kv_cache_disk_gib=2.5)
    assert c.kv_cache_dir == str(tmp_path / "s") and c.kv_cache_disk_gib == 2.5
    assert engine_config("cpu", 4, None, 64, None, 8192, 0, None, False, None).kv_cache_dir is None
