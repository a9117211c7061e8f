"""The KV pool's default size (lmkit/memory.py): capped by max_batch_size x session_len, else by a memory
budget shared with the other lmkit engines of the host through records in LMKIT_RUNTIME_DIR."""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import subprocess
import sys
import textwrap
from contextlib import closing

import pytest

from lmkit import EngineConfig
from lmkit import memory
from lmkit.engine import Engine
from lmkit.memory import MemoryBudgetError, MemoryLimit, Reservations, format_bytes

BLOCK = 16
SESSION = 100
SESSION_BLOCKS = math.ceil(SESSION / BLOCK)  # 7


@pytest.fixture(autouse=True)
def runtime_dir(tmp_path, monkeypatch):
    """Each test has its own records folder: engines of other test processes on this host stay out."""
    folder = tmp_path / "runtime"
    monkeypatch.setenv("LMKIT_RUNTIME_DIR", str(folder))
    return folder


def config(**overrides) -> EngineConfig:
    base = dict(device="cpu", dtype="float32", max_batch_size=4, session_len=SESSION, cache_block_seq_len=BLOCK,
                num_threads=1)
    return EngineConfig(**{**base, **overrides})


def fake_total(monkeypatch, total_bytes: int) -> None:
    monkeypatch.setattr(memory, "memory_limit", lambda: MemoryLimit(total_bytes, "test"))


def records(folder) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


@pytest.fixture(scope="module")
def sizes(tiny_llama, tmp_path_factory):
    """(weight bytes as loaded, bytes per KV block) of the tiny model at block size BLOCK."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMKIT_RUNTIME_DIR", str(tmp_path_factory.mktemp("sizes")))
        with closing(Engine(tiny_llama[0], config(cache_max_entry_count=64))) as e:
            return e.kv_pool.weight_bytes, e.kv_bytes_per_block


def total_for(budget_bytes: float, fraction: float = 0.8) -> int:
    """A memory total whose fraction is budget_bytes."""
    return math.ceil(budget_bytes / fraction)


def test_default_pool_is_what_max_batch_size_sessions_use(tiny_llama, runtime_dir, caplog):
    caplog.set_level(logging.INFO, logger="lmkit")
    with closing(Engine(tiny_llama[0], config())) as e:  # this host's real memory: plenty for the tiny model
        assert e.num_total_blocks == 4 * SESSION_BLOCKS == 28
        pool = e.kv_pool
        assert pool.limited_by == "max_batch_size x session_len"
        assert pool.kv_bytes_per_block == e.kv_bytes_per_block
        spec = e.spec  # fp32 tensors read where mapped: embeddings and the 2 x 2 + 1 norms
        unpacked = (spec.vocab_size * spec.hidden_size + (2 * spec.num_layers + 1) * spec.hidden_size) * 4
        assert pool.weight_bytes == e.linear_weight_bytes + unpacked
        assert pool.memory.total_bytes <= memory.memory_limit().total_bytes
        line = caplog.records[-1].getMessage()
        assert line.startswith(f"KV pool: 28 blocks x {BLOCK} tokens = {28 * BLOCK} tokens, "
                               f"{format_bytes(28 * e.kv_bytes_per_block)}"), line
        assert "limited by max_batch_size x session_len (4 x 100 tokens)" in line, line
        [record] = records(runtime_dir)
        assert record["pid"] == os.getpid()
        assert record["weight_bytes"] == pool.weight_bytes and record["kv_bytes"] == 28 * e.kv_bytes_per_block


def test_prefix_caching_has_the_same_cap(tiny_llama):
    with closing(Engine(tiny_llama[0], config(enable_prefix_caching=True, max_batch_size=3))) as e:
        assert e.num_total_blocks == 3 * SESSION_BLOCKS == e.kv_pool.cap_blocks
        assert e.kv_pool.limited_by == "max_batch_size x session_len"


def test_a_small_memory_decides_and_the_line_says_why(tiny_llama, sizes, monkeypatch, caplog):
    weight_bytes, per_block = sizes
    total = total_for(weight_bytes + 10.5 * per_block)
    fake_total(monkeypatch, total)
    caplog.set_level(logging.INFO, logger="lmkit")
    with closing(Engine(tiny_llama[0], config(max_batch_size=8, cache_max_entry_count=0.8))) as e:
        assert e.num_total_blocks == 10 == (int(0.8 * total) - weight_bytes) // per_block
        assert e.kv_pool.limited_by == "memory"
        line = caplog.records[-1].getMessage()
    assert line.startswith(f"KV pool: 10 blocks x {BLOCK} tokens = 160 tokens, {format_bytes(10 * per_block)}"), line
    assert (f"limited by memory: 0.8 x {format_bytes(total)} (test) - {format_bytes(weight_bytes)} weights - 0 B "
            f"held by other lmkit engines = {format_bytes(int(0.8 * total) - weight_bytes)}") in line, line
    assert f"max_batch_size x session_len would use {8 * SESSION_BLOCKS} blocks" in line, line


def test_the_disk_stores_queue_comes_out_of_the_budget(tiny_llama, sizes, monkeypatch, caplog, runtime_dir,
                                                       tmp_path):
    """kv_cache_dir: the copies of evicted blocks waiting for the store's writer (STORE_QUEUE_BYTES, 8 to 4,096
    blocks) are taken before the KV budget, counted in the engine's reservation and named in the start-up line."""
    assert memory.store_queue_blocks(2**20) == 256
    assert memory.store_queue_blocks(2**30) == 8 and memory.store_queue_blocks(100) == 4096
    weight_bytes, per_block = sizes
    queue = memory.store_queue_blocks(per_block) * per_block
    total = total_for(weight_bytes + queue + 10.5 * per_block)
    fake_total(monkeypatch, total)
    caplog.set_level(logging.INFO, logger="lmkit")
    with closing(Engine(tiny_llama[0], config(max_batch_size=8, cache_max_entry_count=0.8, enable_prefix_caching=True,
                                              kv_cache_dir=tmp_path / "kv"))) as e:
        assert e.num_total_blocks == 10 == (int(0.8 * total) - weight_bytes - queue) // per_block
        assert e.kv_pool.store_queue_bytes == queue
        assert records(runtime_dir)[0]["kv_bytes"] == 10 * per_block + queue
    lines = [r.getMessage() for r in caplog.records if "KV pool:" in r.getMessage()][-1]
    assert f"- {format_bytes(queue)} disk store queue" in lines, lines
    assert f"disk store queue: up to {memory.store_queue_blocks(per_block)} evicted blocks" in lines, lines


def test_a_block_count_is_kept_whatever_the_memory(tiny_llama, sizes, monkeypatch, runtime_dir):
    fake_total(monkeypatch, sizes[0])  # the weights fit (else the engine refuses to load), no room for the KV
    with closing(Engine(tiny_llama[0], config(cache_max_entry_count=40))) as e:
        assert e.num_total_blocks == 40 and e.kv_pool.limited_by == "cache_max_entry_count"
        assert records(runtime_dir)[0]["kv_bytes"] == 40 * sizes[1]  # others still see it


def test_engines_share_the_budget(tiny_llama, sizes, monkeypatch, caplog):
    weight_bytes, per_block = sizes
    total = total_for(2 * weight_bytes + (14 + 10.5) * per_block)
    fake_total(monkeypatch, total)
    caplog.set_level(logging.INFO, logger="lmkit")
    a = Engine(tiny_llama[0], config(max_batch_size=2, cache_max_entry_count=0.8))
    assert a.num_total_blocks == 2 * SESSION_BLOCKS == 14  # capped by its batch
    with closing(Engine(tiny_llama[0], config(max_batch_size=8, cache_max_entry_count=0.8))) as b:
        assert b.num_total_blocks == 10  # what a left
        [other] = b.kv_pool.others
        assert (other.pid, other.total_bytes) == (os.getpid(), weight_bytes + 14 * per_block)
        assert 2 * weight_bytes + (a.num_total_blocks + b.num_total_blocks) * per_block <= int(0.8 * total)
        assert (f"- {format_bytes(weight_bytes + 14 * per_block)} held by other lmkit engines "
                f"[pid {os.getpid()}: {format_bytes(weight_bytes + 14 * per_block)}") in caplog.records[-1].getMessage()
        with pytest.raises(MemoryBudgetError) as failed:  # nothing left for a third
            Engine(tiny_llama[0], config(cache_max_entry_count=0.8))
    message = str(failed.value)
    assert f"one sequence of session_len={SESSION} tokens needs {SESSION_BLOCKS} blocks" in message, message
    assert f"pid {os.getpid()}: {format_bytes(weight_bytes + 14 * per_block)}" in message, message
    assert "Lower session_len" in message and "block count (> 1)" in message, message
    a.close()  # its reservation goes with it
    with closing(Engine(tiny_llama[0], config(max_batch_size=16, cache_max_entry_count=0.8))) as c:
        assert c.num_total_blocks == (int(0.8 * total) - weight_bytes) // per_block and not c.kv_pool.others
        assert c.kv_pool.limited_by == "memory"


def test_too_little_memory_fails_before_the_pool_naming_the_numbers(tiny_llama, sizes, monkeypatch, runtime_dir):
    weight_bytes, per_block = sizes
    total = total_for(weight_bytes + 6.5 * per_block)  # one sequence needs 7 blocks
    fake_total(monkeypatch, total)
    with pytest.raises(MemoryBudgetError) as failed:
        Engine(tiny_llama[0], config(cache_max_entry_count=0.8))
    message = str(failed.value)
    assert message.startswith(
        f"the KV pool does not fit in memory: one sequence of session_len={SESSION} tokens needs {SESSION_BLOCKS} "
        f"blocks = {format_bytes(SESSION_BLOCKS * per_block)} ({format_bytes(per_block)} per block of {BLOCK} "
        f"tokens), and cache_max_entry_count leaves {format_bytes(int(0.8 * total) - weight_bytes)}: 0.8 x "
        f"{format_bytes(total)} (test) - {format_bytes(weight_bytes)} weights"), message
    assert records(runtime_dir) == []
    fake_total(monkeypatch, total_for(weight_bytes + 7 * per_block))  # one sequence fits: the lock was released
    with closing(Engine(tiny_llama[0], config(cache_max_entry_count=0.8))) as e:
        assert e.num_total_blocks == SESSION_BLOCKS


def test_close_and_garbage_collection_remove_the_record(tiny_llama, runtime_dir):
    e = Engine(tiny_llama[0], config())
    assert len(records(runtime_dir)) == 1
    e.close()
    assert records(runtime_dir) == []
    e = Engine(tiny_llama[0], config())
    assert len(records(runtime_dir)) == 1
    del e
    gc.collect()
    assert records(runtime_dir) == []


def test_another_process_is_seen_until_it_is_killed(tiny_llama, runtime_dir, monkeypatch):
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from lmkit import EngineConfig
            from lmkit.engine import Engine
            e = Engine({str(tiny_llama[0])!r}, EngineConfig(device="cpu", dtype="float32", max_batch_size=2,
                                                           session_len={SESSION}, cache_block_seq_len={BLOCK},
                                                           num_threads=1))
            print(e.kv_pool.weight_bytes + e.kv_pool.kv_bytes, flush=True)
            sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ})
    try:
        child_bytes = int(child.stdout.readline())
        with closing(Engine(tiny_llama[0], config())) as e:
            assert [(r.pid, r.total_bytes) for r in e.kv_pool.others] == [(child.pid, child_bytes)]
    finally:
        child.kill()  # no close(): its record stays behind
        child.wait()
    assert [r["pid"] for r in records(runtime_dir)] == [child.pid]
    with closing(Engine(tiny_llama[0], config())) as e:
        assert e.kv_pool.others == ()
        assert [r["pid"] for r in records(runtime_dir)] == [os.getpid()]  # the dead one's record was deleted


def test_stale_records_are_ignored_and_deleted(runtime_dir):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(done.stdout)
    reservations = Reservations(runtime_dir)
    with reservations.lock():
        mine = reservations.add(1000, 2000, "live")
        runtime_dir.joinpath(f"{dead_pid}-1.json").write_text(json.dumps(
            {"pid": dead_pid, "started": "1", "weight_bytes": 5, "kv_bytes": 5, "model": "dead"}))
        runtime_dir.joinpath(f"{os.getpid()}-99.json").write_text(json.dumps(  # this pid, another process's start
            {"pid": os.getpid(), "started": "-1", "weight_bytes": 5, "kv_bytes": 5, "model": "reused pid"}))
        assert [(r.pid, r.total_bytes, r.model) for r in reservations.live()] == [(os.getpid(), 3000, "live")]
    assert sorted(p.name for p in runtime_dir.glob("*.json")) == [mine.path.name]
    mine.remove()
    assert list(runtime_dir.glob("*.json")) == []


def test_memory_limit_reads_cgroups(tmp_path):
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:       16384 kB\nMemFree:         1024 kB\n")
    assert memory.memory_limit(proc, cgroup) == MemoryLimit(16 << 20, "MemTotal")  # no cgroup files
    # v2: the lowest limit of the process's cgroup and its ancestors ("max": none at that level)
    (proc / "self" / "cgroup").write_text("0::/a/b\n")
    (cgroup / "a" / "b").mkdir(parents=True)
    (cgroup / "a" / "b" / "memory.max").write_text("max\n")
    (cgroup / "a" / "memory.max").write_text(f"{8 << 20}\n")
    assert memory.memory_limit(proc, cgroup) == MemoryLimit(8 << 20, f"cgroup limit {cgroup / 'a' / 'memory.max'}")
    (cgroup / "a" / "b" / "memory.max").write_text(f"{4 << 20}\n")
    assert memory.memory_limit(proc, cgroup).total_bytes == 4 << 20
    (cgroup / "a" / "b" / "memory.max").write_text(f"{32 << 20}\n")  # above MemTotal and the parent's
    assert memory.memory_limit(proc, cgroup).total_bytes == 8 << 20
    # v1, in a container: the host's path is not mounted, the container's limit is at the root
    (proc / "self" / "cgroup").write_text("7:cpu,cpuacct:/docker/abc\n5:memory:/docker/abc\n")
    (cgroup / "memory").mkdir()
    (cgroup / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # unlimited
    assert memory.memory_limit(proc, cgroup).total_bytes == 16 << 20
    (cgroup / "memory" / "memory.limit_in_bytes").write_text(f"{2 << 20}\n")
    assert memory.memory_limit(proc, cgroup) == MemoryLimit(
        2 << 20, f"cgroup limit {cgroup / 'memory' / 'memory.limit_in_bytes'}")


def test_this_hosts_memory_limit():
    with open("/proc/meminfo") as f:
        mem_total = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    limit = memory.memory_limit()
    assert 0 < limit.total_bytes <= mem_total, limit


def test_auto_takes_half_of_what_is_left_so_a_second_engine_fits(tiny_llama, sizes, monkeypatch, caplog):
    """The default (cache_max_entry_count None): two engines started one after the other both get a pool (the
    README's two nodes on one host), the first half of what was left, the second half of the rest."""
    weight_bytes, per_block = sizes
    total = total_for(2 * weight_bytes + 200.5 * per_block)
    fake_total(monkeypatch, total)
    caplog.set_level(logging.INFO, logger="lmkit")
    left = int(0.8 * total) - weight_bytes
    with closing(Engine(tiny_llama[0], config(max_batch_size=64))) as a:
        assert a.num_total_blocks == (left // 2) // per_block > SESSION_BLOCKS and a.kv_pool.limited_by == "memory"
        assert "limited by memory: half of (0.8 x" in caplog.records[-1].getMessage()
        left_b = left - weight_bytes - a.num_total_blocks * per_block
        with closing(Engine(tiny_llama[0], config(max_batch_size=64))) as b:
            assert b.num_total_blocks == max((left_b // 2) // per_block, SESSION_BLOCKS)
            assert 2 * weight_bytes + (a.num_total_blocks + b.num_total_blocks) * per_block <= int(0.8 * total)


def test_auto_takes_one_sequence_when_half_is_less(tiny_llama, sizes, monkeypatch):
    weight_bytes, per_block = sizes
    fake_total(monkeypatch, total_for(weight_bytes + 9.5 * per_block))  # half is 4 blocks, one sequence 7
    with closing(Engine(tiny_llama[0], config())) as e:
        assert e.num_total_blocks == SESSION_BLOCKS
    fake_total(monkeypatch, total_for(weight_bytes + 6.5 * per_block))  # not even one sequence
    with pytest.raises(MemoryBudgetError):
        Engine(tiny_llama[0], config())


def test_weights_larger_than_memory_fail_before_loading(tiny_llama, monkeypatch, runtime_dir):
    """A model whose weights exceed the memory limit is refused before anything is packed, naming both sizes."""
    from lmkit.models import load_model_spec

    need = memory.checkpoint_weight_bytes(load_model_spec(tiny_llama[0]))
    fake_total(monkeypatch, need - 1)
    with pytest.raises(ValueError, match=rf"its weights take {memory.format_bytes(need)} once loaded, more than the "
                                         rf"{memory.format_bytes(need - 1)} this process may use \(test\)"):
        Engine(tiny_llama[0], config(cache_max_entry_count=64))
    assert records(runtime_dir) == []


@pytest.mark.parametrize("count, says", [(None, "0.8 of the GPU memory free after the weights (auto)"),
                                         (0.5, "0.5 of the GPU memory free after the weights, at most"),
                                         (300, "set by cache_max_entry_count=300")])
def test_cuda_pool_line_says_what_sized_it(count, says, caplog):
    """The CUDA engine's start-up line (plan_cuda_kv_pool sized the pool); cache_max_entry_count None is the
    default, auto, and must not break it (it did on the first GPU run)."""
    from types import SimpleNamespace

    caplog.set_level(logging.INFO, logger="lmkit")
    cpp = SimpleNamespace(num_total_blocks=300, block_size_tokens=64, kv_bytes_per_block=1 << 20)
    memory.log_cuda_kv_pool(cpp, count)
    line = caplog.records[-1].getMessage()
    assert line.startswith("KV pool: 300 blocks x 64 tokens = 19200 tokens, 300.0 MiB of GPU memory"), line
    assert says in line, line


def test_cuda_pool_is_a_share_of_free_gpu_memory_capped_by_the_batch():
    """plan_cuda_kv_pool, what every CUDA engine's create_engine calls back (there is no formula in C++): a block
    count is kept, a fraction takes that share of the free GPU bytes (auto: AUTO_MEMORY_FRACTION) at most
    max_batch_size x session_len, and a share without room for one block is refused naming the numbers."""
    per_block = 1000
    cap = 4 * SESSION_BLOCKS  # config(): max_batch_size 4, session 100 tokens in blocks of 16
    assert memory.plan_cuda_kv_pool(config(cache_max_entry_count=5), per_block, SESSION, 0) == 5
    assert memory.plan_cuda_kv_pool(config(cache_max_entry_count=0.5), per_block, SESSION, 20_999) == 10
    assert memory.plan_cuda_kv_pool(config(cache_max_entry_count=0.5), per_block, SESSION, 10**9) == cap
    assert memory.plan_cuda_kv_pool(config(), per_block, SESSION, 10_000) == 8  # 0.8 of it
    assert memory.plan_cuda_kv_pool(config(), per_block, 2 * SESSION, 10**9) == 4 * math.ceil(2 * SESSION / BLOCK)
    with pytest.raises(MemoryBudgetError, match=r"cache_max_entry_count=0.5 of 2.0 KiB free GPU memory leaves no "
                                                r"room for one KV block of 1000 B"):
        memory.plan_cuda_kv_pool(config(cache_max_entry_count=0.5), per_block, SESSION, 1_999)
    sizer = memory.CudaPoolSizer(config(cache_max_entry_count=0.5))
    assert sizer(per_block, 0, 123, SESSION, 20_999) == (10, 0, 0, 0)  # what the engine calls: the weights play no part


def test_state_slots_take_at_most_a_share_of_what_is_left():
    """plan_state_slots: max_batch_size slots (twice that with prefix caching) while STATE_POOL_SHARE of the
    memory left after the weights holds them, fewer when it does not, and a refusal naming the numbers when it
    holds not one; a model without recurrent layers has none."""
    share = memory.STATE_POOL_SHARE
    assert memory.plan_state_slots(config(), 0, 10**9).num_slots == 0
    assert memory.plan_state_slots(config(), 1000, 10**9).num_slots == 4
    pool = memory.plan_state_slots(config(enable_prefix_caching=True), 1000, 10**9)
    assert (pool.num_slots, pool.wanted_slots, pool.bytes) == (8, 8, 8000)
    pool = memory.plan_state_slots(config(enable_prefix_caching=True), 1000, int(5999 / share))
    assert pool.num_slots == 5 and "at most 5 sequences run at once" in pool.describe()
    with pytest.raises(MemoryBudgetError, match=r"one sequence's state takes 1000 B"):
        memory.plan_state_slots(config(), 1000, int(999 / share))
    with pytest.raises(MemoryBudgetError):
        memory.plan_state_slots(config(), 1000, -5)


def test_speculation_adds_checkpoint_slots_within_the_share():
    """A speculating engine's state pool also keeps DRAFT_STATE_SEQUENCES x num_speculative_tokens slots for the
    state as of each draft row, counted in its bytes, after the sequences' slots within the same share."""
    share = memory.STATE_POOL_SHARE
    wanted = memory.DRAFT_STATE_SEQUENCES * 3
    pool = memory.plan_state_slots(config(num_speculative_tokens=3), 1000, 10**9, speculative=True)
    assert (pool.num_slots, pool.num_draft_slots, pool.bytes) == (4, wanted, (4 + wanted) * 1000)
    assert f"{4 + wanted} slots" in pool.describe() and f"{wanted} of them ({wanted} wanted)" in pool.describe()
    pool = memory.plan_state_slots(config(num_speculative_tokens=3), 1000, int(5999 / share), speculative=True)
    assert (pool.num_slots, pool.num_draft_slots) == (4, 1)
    assert memory.plan_state_slots(config(num_speculative_tokens=3), 1000, 10**9).num_draft_slots == 0
    assert memory.plan_state_slots(config(), 0, 10**9, speculative=True).bytes == 0


IDLE_RELEASE = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from lmkit import EngineConfig, GenerationConfig
    from lmkit.engine import Engine

    def rss():
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))

    # argv[2] == "draft": the model drafting for itself, every proposal verified (its pool takes the prompt too)
    draft = dict(draft_model=sys.argv[1], speculative_adaptive=False) if sys.argv[2:] == ["draft"] else {}
    engine = Engine(sys.argv[1], EngineConfig(session_len=6200, cache_max_entry_count=0.3, **draft))
    probe = np.random.default_rng(1).integers(3, 256, 300).tolist()
    long = np.random.default_rng(2).integers(3, 256, 6000).tolist()

    def run(ids, **kw):  # every output's tokens (how a step's verification splits them is the pacer's choice)
        _, q = engine.submit_to_queue(ids, GenerationConfig(max_new_tokens=4, ignore_eos=True, logprobs=2, **kw))
        tokens, logprobs = [], []
        while True:
            out = q.get()
            tokens += out.token_ids
            logprobs += out.logprobs
            if out.finish_reason:
                return tokens, logprobs

    first = run(probe)
    time.sleep(2.5)
    idle = rss()
    run(long, prompt_logprobs=5)
    busy = rss()
    time.sleep(2.5)
    after = rss()
    again = run(probe)
    engine.close()
    print(json.dumps({"idle": idle, "busy": busy, "after": after, "tokens": [first[0], again[0]],
                      "logprobs": [len(first[1]), len(again[1])],
                      "logprob_error": max((abs(a - b) for a, b in zip(first[1], again[1])), default=0.0)}))
""")


@pytest.fixture(scope="module")
def wide_kv_llama(tmp_path_factory):
    """A 2-layer Llama whose K/V take about SmolLM2-135M's bytes a token (48 KV heads of 64 a layer: 24 KB in
    bf16) for a tenth of its prefill's compute."""
    import torch
    import transformers

    from tests.factories import TOKEN_IDS, write_byte_tokenizer

    folder = tmp_path_factory.mktemp("wide-kv")
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=48, num_key_value_heads=48, head_dim=64,
                                      max_position_embeddings=8192, **TOKEN_IDS)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(folder))
    write_byte_tokenizer(folder)
    return folder


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("draft", [False, True], ids=["plain", "draft-model"])
def test_an_idle_engine_gives_a_long_prompts_memory_back(wide_kv_llama, draft):
    """A 6,000-token prompt scored makes the engine touch ~190 MB of KV blocks and workspaces; a second after the
    engine goes idle their pages go back to the OS (RSS within a third of what the prompt added: 15% on Zen 5 with
    SmolLM2), and a request afterwards, on the pages touched again, answers exactly as before. With a draft model
    its own pool's blocks (the prompt caught up) and scratch go back too."""
    done = subprocess.run([sys.executable, "-c", IDLE_RELEASE, str(wide_kv_llama)] + (["draft"] if draft else []),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    added = r["busy"] - r["idle"]
    assert added > (200 << 20 if draft else 100 << 20), r  # (the draft's pool holds the prompt's K/V too)
    # (the draft: 4% here; 20% when its pool kept the ended prompt's blocks cached without prefix caching)
    assert r["after"] - r["idle"] < added / (8 if draft else 3), r
    # the same tokens; their logprobs exactly so, or with drafts within float32's rounding of rows that a
    # verification computes in another step's shape (the draft's catch-up may take one step or two)
    assert r["tokens"][0] == r["tokens"][1] and len(r["tokens"][0]) == 4 and r["logprobs"] == [4, 4], r
    assert r["logprob_error"] <= (1e-5 if draft else 0.0), r
