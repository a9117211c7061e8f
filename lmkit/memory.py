"""The KV pool's default size, and the host memory that the lmkit engines of one host share.

Every engine's pool is sized here (the C++ side has no formula of its own), once its weights are packed and
before the pool is allocated: lmkit.Engine hands a sizer to lmkit._engine.Engine, which calls it back with
what only the C++ side knows (bytes per KV block and per recurrent-state slot, packed weight bytes, the resolved
session_len, and on CUDA the GPU memory still free) and allocates the blocks and slots it returns. A CUDA engine's pool is a share of free GPU
memory (plan_cuda_kv_pool); a CPU engine's (``PoolSizer``)::

    blocks       = cache_max_entry_count, when > 1 (a block count, as given); otherwise
                   min(cap_blocks, budget_bytes // kv_bytes_per_block)
    cap_blocks   = max_batch_size * ceil(session_len / cache_block_seq_len)   all a full batch can hold
    left_bytes   = fraction * memory_limit               MemTotal, or the cgroup's limit when lower
                 - weight_bytes                          this engine's weights as loaded
                 - the reservations of the other live lmkit engines of this user on this host
    budget_bytes = left_bytes                            cache_max_entry_count a fraction: all of it
                 = max(left_bytes / 2, one sequence)     None (auto, fraction 0.8): half, so that another
                                                         engine (a second node, `lmkit chat`) fits beside it

The cap holds with prefix caching too: cached blocks are reclaimed before a running sequence waits. A pool
that cannot hold one sequence of session_len tokens is refused (MemoryBudgetError, naming the numbers).

A model with recurrent layers (Qwen3.5) also has a state pool, sized first (plan_state_slots)::

    state_slots  = min(max_batch_size (x 2 with prefix caching: the snapshots prefix hits start from),
                       STATE_POOL_SHARE x left_bytes // state_bytes_per_slot)
    draft_slots  = min(DRAFT_STATE_SEQUENCES x num_speculative_tokens,   speculative decoding's checkpoints
                       what is left of that share after state_slots)

and its bytes are taken from left_bytes before the KV pool's budget, as are those of the disk store's queue
(kv_cache_dir: store_queue_blocks, the evicted blocks' copies waiting for its writer). Fewer slots than
max_batch_size cap how many sequences run at once (the start-up line says so); no slot at all is refused. Fewer
draft slots than wanted cap how many drafts of a stateful model a step verifies.

Reservations: every CPU engine records its weights + KV pool bytes in a file ``<pid>-<n>.json`` of
``lmkit.env.runtime_dir()``. An engine holds that folder's lock (an flock: the kernel drops it if the holder
dies) from before its weights load until its record is written, so engines starting together size one
after the other. ``Engine.close()`` (or its finalizer, at the latest when the process exits) deletes the
record; the record of a process that is gone (its pid dead, a zombie, or reused by a later process) is
ignored and deleted by the next engine that reads it.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import logging
import math
import os
import stat
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from lmkit import env
from lmkit.cgroups import limit_files

from lmkit.config import AUTO_MEMORY_FRACTION

if TYPE_CHECKING:
    from lmkit.config import EngineConfig
    from lmkit.models import ModelSpec

log = logging.getLogger("lmkit")


class MemoryBudgetError(ValueError):
    """The memory left for the KV pool does not hold one sequence of session_len tokens."""


def format_bytes(n: int) -> str:
    """``1.50 GiB``, ``12.0 KiB``, ``512 B``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n} B"


# -- what this process may use ----------------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryLimit:
    """The memory this process may use: the machine's, or its cgroup's limit when lower."""

    total_bytes: int
    source: str  # where total_bytes was read


def memory_limit(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> MemoryLimit:
    """MemTotal of ``proc``/meminfo, or the lowest memory limit (cgroup v2 ``memory.max``, v1
    ``memory.limit_in_bytes``) of this process's cgroup and its ancestors when lower."""
    best = MemoryLimit(_meminfo_total_bytes(proc / "meminfo"), "MemTotal")
    files = limit_files(proc / "self" / "cgroup", cgroup_root, "memory.max", "memory", "memory.limit_in_bytes")
    for path in files:
        value = _read_limit(path)
        if value is not None and value < best.total_bytes:
            best = MemoryLimit(value, f"cgroup limit {path}")
    return best


def _meminfo_total_bytes(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"{path} has no MemTotal line: cannot size the KV pool; give cache_max_entry_count "
                       "a block count (> 1)")


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit at this level


# -- reservations of the engines of this host ---------------------------------------------------------------

@dataclass(frozen=True)
class Reservation:
    """One engine's record: the host memory it holds."""

    pid: int
    started: str | None  # the process's start time (/proc/<pid>/stat): a later process with the same pid is not it
    weight_bytes: int
    kv_bytes: int  # its KV pool and, for a model with recurrent layers, its state pool
    model: str
    path: Path = field(compare=False)

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    def describe(self) -> str:
        return f"pid {self.pid}: {format_bytes(self.total_bytes)} ({self.model})"

    def remove(self) -> None:
        """Deletes the record (no lock needed: an unlink is atomic, and readers skip a vanished file)."""
        self.path.unlink(missing_ok=True)

    def is_live(self) -> bool:
        """Whether its process still runs: the pid exists, is not a zombie, and started when the record says."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        status = _process_status(self.pid)
        if status is None:
            return True  # no /proc to tell a reused pid: count it
        state, started = status
        return state != "Z" and (self.started is None or started == self.started)


def _process_status(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks since boot) from /proc/<pid>/stat, None when unreadable."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": fields 3, 4, ... of proc(5)
    return fields[0], fields[19]


class Reservations:
    """The records of one runtime folder. ``live()`` and ``add()`` run under ``lock()``."""

    _serial = itertools.count(1)  # records of one process: <pid>-1.json, <pid>-2.json, ...

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def __repr__(self) -> str:
        return f"Reservations({str(self.folder)!r})"

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Holds the folder's lock (blocks while another engine sizes its pool)."""
        self._prepare_folder()
        fd = os.open(self.folder / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def live(self) -> list[Reservation]:
        """The records of running processes; deletes those of processes that are gone."""
        records = []
        for path in sorted(self.folder.glob("*.json")):
            try:
                raw = json.loads(path.read_text())
                record = Reservation(int(raw["pid"]), raw.get("started"), int(raw["weight_bytes"]),
                                     int(raw["kv_bytes"]), str(raw.get("model", "?")), path)
            except FileNotFoundError:
                continue  # removed by its engine meanwhile
            except (OSError, ValueError, KeyError, TypeError):
                log.warning("ignoring the unreadable lmkit memory record %s", path)
                continue
            if record.is_live():
                records.append(record)
            else:
                record.remove()
        return records

    def add(self, weight_bytes: int, kv_bytes: int, model: str) -> Reservation:
        """Writes this process's record of one engine and returns it."""
        pid = os.getpid()
        status = _process_status(pid)
        record = Reservation(pid, status[1] if status else None, int(weight_bytes), int(kv_bytes), model,
                             self.folder / f"{pid}-{next(self._serial)}.json")
        tmp = record.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": record.pid, "started": record.started, "weight_bytes": record.weight_bytes,
                                   "kv_bytes": record.kv_bytes, "model": record.model}))
        os.replace(tmp, record.path)
        return record

    def _prepare_folder(self) -> None:
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = os.lstat(self.folder)
        except OSError as e:
            raise RuntimeError(f"cannot use {self.folder} for lmkit's memory records ({e}); set LMKIT_RUNTIME_DIR "
                               "to a writable folder of your own") from None
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise RuntimeError(f"{self.folder} (lmkit's memory records) is not a folder owned by this user; set "
                               "LMKIT_RUNTIME_DIR to a folder of your own")


# -- sizing ---------------------------------------------------------------------------------------------------

def cap_blocks(max_batch_size: int, session_len: int, block_size_tokens: int) -> int:
    """What max_batch_size sequences of session_len tokens can ever use: more KV blocks are never needed."""
    return max_batch_size * math.ceil(session_len / block_size_tokens)


STATE_POOL_SHARE = 0.25
"""The most of what is left after the weights (left_bytes) a recurrent-state pool may take."""
STORE_QUEUE_BYTES = 256 * 2**20
"""The disk store (kv_cache_dir): the copies of evicted blocks waiting for its writer take this at most (a prefill
chunk may evict hundreds of blocks at once; store_queue_blocks)."""
DRAFT_STATE_SEQUENCES = 2
"""Speculative decoding on a model with recurrent layers: every draft row of a step needs a slot for the state as of
it (the rollback's checkpoint); the pool keeps as many as this many sequences' full drafts take."""


@dataclass(frozen=True)
class StatePool:
    """How a model's recurrent-state pool was sized (``KVPool.state``; all 0 for a model without one)."""

    num_slots: int  # for sequences and prefix-cache snapshots
    bytes_per_slot: int
    wanted_slots: int  # max_batch_size, twice that with prefix caching
    limit_bytes: int  # the share of the memory it may take
    num_draft_slots: int = 0  # besides those, speculative decoding's checkpoints
    wanted_draft_slots: int = 0

    @property
    def bytes(self) -> int:
        return (self.num_slots + self.num_draft_slots) * self.bytes_per_slot

    def describe(self) -> str:
        slots = self.num_slots + self.num_draft_slots
        text = f"recurrent-state pool: {slots} slots x {format_bytes(self.bytes_per_slot)} = {format_bytes(self.bytes)}"
        if self.num_slots == self.wanted_slots:
            text += " (a slot per sequence of max_batch_size, and one per prefix-cache snapshot with prefix caching)"
        else:
            text += (f", limited by memory ({STATE_POOL_SHARE:g} of what is left after the weights: "
                     f"{format_bytes(self.limit_bytes)}; {self.wanted_slots} slots wanted): at most {self.num_slots} "
                     "sequences run at once")
        if self.wanted_draft_slots:
            text += (f"; {self.num_draft_slots} of them ({self.wanted_draft_slots} wanted) keep the state as of each "
                     "draft token a step verifies (speculative decoding)")
        return text


@dataclass(frozen=True)
class KVPool:
    """How a CPU engine's KV pool was sized (``Engine.kv_pool``): the numbers of its start-up line."""

    num_blocks: int
    block_size_tokens: int
    kv_bytes_per_block: int
    limited_by: str  # "cache_max_entry_count" (a block count), "max_batch_size x session_len", "memory", "no KV"
    max_batch_size: int
    session_len: int
    fraction: float | None  # cache_max_entry_count when it is a fraction, AUTO_MEMORY_FRACTION when auto
    is_auto: bool  # cache_max_entry_count None: the pool takes half of what is left
    memory: MemoryLimit
    weight_bytes: int  # this engine's weights as loaded
    others: tuple[Reservation, ...]  # the other live engines' records when it was sized
    state: StatePool = field(default_factory=lambda: StatePool(0, 0, 0, 0))  # taken before the KV budget
    store_queue_blocks: int = 0  # the disk store's queue (kv_cache_dir), taken before the KV budget too

    @property
    def store_queue_bytes(self) -> int:
        return self.store_queue_blocks * self.kv_bytes_per_block

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size_tokens

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.kv_bytes_per_block

    @property
    def cap_blocks(self) -> int:
        return cap_blocks(self.max_batch_size, self.session_len, self.block_size_tokens)

    @property
    def others_bytes(self) -> int:
        return sum(r.total_bytes for r in self.others)

    @property
    def left_bytes(self) -> int | None:
        """fraction x memory - weights - state pool - disk store queue - the others' reservations (None for a block
        count)."""
        if self.fraction is None:
            return None
        return (int(self.fraction * self.memory.total_bytes) - self.weight_bytes - self.state.bytes
                - self.store_queue_bytes - self.others_bytes)

    @property
    def pool_bytes(self) -> int:
        """The KV pool's, the state pool's and the disk store queue's bytes: what this engine reserves beside its
        weights."""
        return self.kv_bytes + self.state.bytes + self.store_queue_bytes

    @property
    def budget_bytes(self) -> int | None:
        """What the pool may take: all that is left, or half of it when auto (None for a block count)."""
        left = self.left_bytes
        return left // 2 if left is not None and self.is_auto else left

    def budget_text(self) -> str:
        others = f" [{', '.join(r.describe() for r in self.others)}]" if self.others else ""
        state = f" - {format_bytes(self.state.bytes)} recurrent state" if self.state.bytes else ""
        if self.store_queue_blocks:
            state += f" - {format_bytes(self.store_queue_bytes)} disk store queue"
        text = (f"{self.fraction:g} x {format_bytes(self.memory.total_bytes)} ({self.memory.source}) "
                f"- {format_bytes(self.weight_bytes)} weights{state} - {format_bytes(self.others_bytes)} held by "
                f"other lmkit engines{others}")
        if self.is_auto:
            return f"half of ({text}) = {format_bytes(self.budget_bytes)}, leaving room for another engine"
        return f"{text} = {format_bytes(self.budget_bytes)}"

    def describe(self) -> str:
        """The start-up line(s): blocks, tokens, bytes, and why; the state pool's first when there is one, the disk
        store queue's last."""
        lines = [self.state.describe()] if self.state.num_slots else []
        lines.append(self._describe_kv())
        if self.store_queue_blocks:
            lines.append(f"disk store queue: up to {self.store_queue_blocks} evicted blocks = "
                         f"{format_bytes(self.store_queue_bytes)} waiting for the writer (kv_cache_dir)")
        return "\n".join(lines)

    def _describe_kv(self) -> str:
        head = (f"KV pool: {self.num_blocks} blocks x {self.block_size_tokens} tokens = {self.num_tokens} tokens, "
                f"{format_bytes(self.kv_bytes)} ({format_bytes(self.kv_bytes_per_block)} per block); ")
        if self.limited_by == "cache_max_entry_count":
            return head + f"set by cache_max_entry_count={self.num_blocks}"
        if self.limited_by == "no KV":
            return head + "no layer keeps K/V (every layer is recurrent): max_batch_size x session_len"
        if self.limited_by == "memory":
            return (head + f"limited by memory: {self.budget_text()}; max_batch_size x session_len would use "
                    f"{self.cap_blocks} blocks")
        return (head + f"limited by max_batch_size x session_len ({self.max_batch_size} x {self.session_len} tokens); "
                f"memory allows {self.budget_bytes // self.kv_bytes_per_block} blocks: {self.budget_text()}")


def store_queue_blocks(kv_bytes_per_block: int) -> int:
    """The disk store's queue: STORE_QUEUE_BYTES of blocks, at least 8 and at most 4,096."""
    return min(4096, max(8, STORE_QUEUE_BYTES // max(kv_bytes_per_block, 1)))


def plan_state_slots(config: "EngineConfig", state_bytes_per_slot: int, left_bytes: int,
                     speculative: bool = False) -> StatePool:
    """The state pool of a model whose recurrent layers keep ``state_bytes_per_slot`` per sequence (module doc);
    ``left_bytes``: the memory left after the weights; ``speculative``: the engine verifies drafts (it then wants
    checkpoint slots). Raises MemoryBudgetError when not one slot fits."""
    if state_bytes_per_slot <= 0:
        return StatePool(0, 0, 0, 0)
    wanted = config.max_batch_size * (2 if config.enable_prefix_caching else 1)
    limit = int(STATE_POOL_SHARE * max(left_bytes, 0))
    slots = min(wanted, limit // state_bytes_per_slot)
    if slots < 1:
        raise MemoryBudgetError(
            f"the recurrent-state pool does not fit in memory: one sequence's state takes "
            f"{format_bytes(state_bytes_per_slot)}, and the pool may take {STATE_POOL_SHARE:g} of the "
            f"{format_bytes(max(left_bytes, 0))} left after the weights ({format_bytes(limit)}); use a machine with "
            "more memory, a quantized checkpoint, or restart the other lmkit engines")
    wanted_drafts = DRAFT_STATE_SEQUENCES * config.num_speculative_tokens if speculative else 0
    drafts = min(wanted_drafts, (limit - slots * state_bytes_per_slot) // state_bytes_per_slot)
    return StatePool(int(slots), state_bytes_per_slot, wanted, limit, int(drafts), wanted_drafts)


def plan_kv_pool(config: "EngineConfig", kv_bytes_per_block: int, weight_bytes: int, session_len: int,
                 memory: MemoryLimit, others: tuple[Reservation, ...] = (), state_bytes_per_slot: int = 0,
                 speculative: bool = False) -> KVPool:
    """The KV pool for ``config`` (module doc), and the state pool beside it when ``state_bytes_per_slot``
    (with draft checkpoint slots when ``speculative``).
    Raises MemoryBudgetError when a fraction leaves less than one sequence of session_len tokens."""
    count = config.cache_max_entry_count
    is_auto = count is None
    pool = KVPool(num_blocks=0, block_size_tokens=config.cache_block_seq_len, kv_bytes_per_block=kv_bytes_per_block,
                  limited_by="cache_max_entry_count", max_batch_size=config.max_batch_size, session_len=session_len,
                  fraction=AUTO_MEMORY_FRACTION if is_auto else (None if count > 1 else float(count)), is_auto=is_auto,
                  memory=memory, weight_bytes=weight_bytes, others=tuple(others))
    if config.kv_cache_dir is not None:
        pool = replace(pool, store_queue_blocks=store_queue_blocks(kv_bytes_per_block))
    if state_bytes_per_slot:  # sized from what the weights leave, with the fraction a block count does not give
        left = replace(pool, fraction=AUTO_MEMORY_FRACTION if pool.fraction is None else pool.fraction).left_bytes
        pool = replace(pool, state=plan_state_slots(config, state_bytes_per_slot, left, speculative))
    if not is_auto and count > 1:
        return replace(pool, num_blocks=int(count))
    if kv_bytes_per_block == 0:  # no layer keeps K/V (every layer recurrent): blocks are bookkeeping only
        return replace(pool, num_blocks=pool.cap_blocks, limited_by="no KV")
    min_blocks = math.ceil(session_len / config.cache_block_seq_len)
    budget = pool.budget_bytes
    budget_blocks = max(budget, 0) // kv_bytes_per_block
    if is_auto and budget_blocks < min_blocks <= max(pool.left_bytes, 0) // kv_bytes_per_block:
        budget_blocks = min_blocks  # half is not one sequence, but what is left is: take one sequence's worth
    if budget_blocks < min_blocks:
        raise MemoryBudgetError(
            f"the KV pool does not fit in memory: one sequence of session_len={session_len} tokens needs "
            f"{min_blocks} blocks = {format_bytes(min_blocks * kv_bytes_per_block)} "
            f"({format_bytes(kv_bytes_per_block)} per block of {config.cache_block_seq_len} tokens), and "
            f"cache_max_entry_count leaves {format_bytes(budget) if budget > 0 else 'nothing'}: {pool.budget_text()}. "
            f"Lower session_len, or quant_policy=8 / 4 (int8 / int4 KV blocks), or give cache_max_entry_count a "
            f"block count (> 1) or a larger fraction, or restart the other lmkit engines with a smaller "
            f"max_batch_size / session_len / cache_max_entry_count")
    if budget_blocks < pool.cap_blocks:
        return replace(pool, num_blocks=int(budget_blocks), limited_by="memory")
    return replace(pool, num_blocks=pool.cap_blocks, limited_by="max_batch_size x session_len")


# the roles EngineConfig.quantization="int8" rounds (csrc/model/model.cpp's pack_linear(..., projection = true)): the
# attention, MLP and expert projections, per expert or stacked ([E, N, K]; GGUF's *_exps), and the Gated DeltaNet
# layers' input and output projections; not routers, gates or per-layer projections
_ROUNDED_AT_LOAD = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj",
                    "gate_up_proj", "out_proj", "gate_exps", "up_exps", "down_exps", "in_proj_qkv", "in_proj_z",
                    "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba")


def checkpoint_weight_bytes(spec: "ModelSpec", int8_at_load: bool = False) -> int:
    """Bytes of every tensor the engine loads, as stored (what the weights take once packed, within a few
    percent: the CPU backend packs dense layers in their stored dtype and AWQ int4 as int4; FP8 weights are decoded
    at load into bf16 or fp32: counted as bf16, the least they take; NVFP4's one-byte block scales are packed as
    fp16: counted twice). ``int8_at_load`` (EngineConfig.quantization="int8"): float projections count as int8 with
    an fp16 scale per 32 values."""
    def packed(role: str, e) -> int:
        if int8_at_load and role.rsplit(".", 1)[-1] in _ROUNDED_AT_LOAD and e.dtype in ("F32", "F16", "BF16") \
                and len(e.shape) >= 2 and e.shape[-1] % 32 == 0:
            return e.nbytes // {"F32": 4, "F16": 2, "BF16": 2}[e.dtype] * 17 // 16
        doubled = e.dtype == "F8_E4M3" or (role.endswith(".scales") and f"{role[:-7]}.global_scale" in spec.sources)
        return e.nbytes * (2 if doubled else 1)

    return sum(packed(role, e) for role, e in spec.sources.items())


def unpacked_weight_bytes(spec: "ModelSpec") -> int:
    """Bytes of the tensors the CPU backend reads where they are mapped (embeddings, norms, biases). The
    weights as loaded are these plus the packed linear layers and lm_head (``Engine.linear_weight_bytes``)."""
    return sum(e.nbytes for role, e in spec.sources.items()
               if role != "lm_head" and "_proj" not in role)


class PoolSizer:
    """The ``size_pools`` callback of a CPU lmkit._engine.Engine: (kv_bytes_per_block, state_bytes_per_slot,
    linear_weight_bytes, session_len, device_free_bytes) -> (KV blocks, state slots, draft checkpoint slots,
    disk-store queue blocks), called once on the creating thread; keeps the KVPool it chose (its state pool in ``kv_pool.state``) in
    ``kv_pool``. speculative: the engine verifies drafts."""

    def __init__(self, config: "EngineConfig", unpacked_bytes: int, others: tuple[Reservation, ...],
                 memory: MemoryLimit, speculative: bool = False):
        self.config, self.unpacked_bytes, self.others, self.memory = config, unpacked_bytes, others, memory
        self.speculative = speculative
        self.kv_pool: KVPool | None = None
        self.reservation: Reservation | None = None

    def __call__(self, kv_bytes_per_block: int, state_bytes_per_slot: int, linear_weight_bytes: int,
                 session_len: int, device_free_bytes: int = 0) -> tuple[int, int, int, int]:
        self.kv_pool = plan_kv_pool(self.config, kv_bytes_per_block, linear_weight_bytes + self.unpacked_bytes,
                                    session_len, self.memory, self.others, state_bytes_per_slot, self.speculative)
        pool = self.kv_pool
        return pool.num_blocks, pool.state.num_slots, pool.state.num_draft_slots, pool.store_queue_blocks


@contextmanager
def reserve_kv_pool(config: "EngineConfig", spec: "ModelSpec", speculative: bool = False,
                    draft: "ModelSpec | None" = None) -> Iterator[PoolSizer]:
    """For a CPU engine created inside the block (``speculative``: it verifies drafts; ``draft``: its draft model's
    spec, whose weights count with the model's): holds the runtime folder's lock, yields the sizer to hand to
    lmkit._engine.Engine, then records the engine's reservation (``sizer.reservation``; the caller removes it when
    the engine closes) and logs the start-up line. A block that raises records nothing."""
    limit = memory_limit()
    models = (spec,) if draft is None else (spec, draft)
    need = sum(checkpoint_weight_bytes(m, int8_at_load=config.quantization == "int8") for m in models)
    if need > limit.total_bytes:  # before anything is packed or mapped in: the OOM killer would answer otherwise
        with_draft = f" with the draft model {draft.path}" if draft is not None else ""
        raise ValueError(f"{spec.path}{with_draft}: its weights take {format_bytes(need)} once loaded, more than the "
                         f"{format_bytes(limit.total_bytes)} this process may use ({limit.source}); use a quantized "
                         "checkpoint (lmkit lite awq) or a machine with more memory")
    reservations = Reservations(env.runtime_dir())
    with reservations.lock():
        sizer = PoolSizer(config, sum(unpacked_weight_bytes(m) for m in models), tuple(reservations.live()), limit,
                          speculative)
        yield sizer
        if sizer.kv_pool is None:
            raise RuntimeError("the engine was created without calling its KV pool sizer")
        sizer.reservation = reservations.add(sizer.kv_pool.weight_bytes, sizer.kv_pool.pool_bytes, str(spec.path))
    log.info("%s", sizer.kv_pool.describe())


def plan_cuda_kv_pool(config: "EngineConfig", kv_bytes_per_block: int, session_len: int, free_bytes: int) -> int:
    """The block count of a CUDA engine's KV pool: cache_max_entry_count when > 1 (a block count); otherwise that
    fraction (AUTO_MEMORY_FRACTION when None) of the GPU memory free once the weights and workspaces are in, at
    most what max_batch_size sequences of session_len tokens can use. Raises MemoryBudgetError when that leaves
    no room for one block."""
    count = config.cache_max_entry_count
    fraction = AUTO_MEMORY_FRACTION if count is None else float(count)
    if fraction > 1:
        return int(fraction)
    cap = cap_blocks(config.max_batch_size, session_len, config.cache_block_seq_len)
    blocks = min(int(fraction * free_bytes) // kv_bytes_per_block, cap)
    if blocks < 1:
        raise MemoryBudgetError(
            f"cache_max_entry_count={fraction:g} of {format_bytes(free_bytes)} free GPU memory leaves no room for one "
            f"KV block of {format_bytes(kv_bytes_per_block)}; raise it or pass a block count (> 1)")
    return min(blocks, 2**31 - 1)


class CudaPoolSizer:
    """The ``size_pools`` callback of a CUDA lmkit._engine.Engine (plan_cuda_kv_pool; plan_state_slots from the
    free GPU memory, the CUDA backend refusing recurrent layers today)."""

    def __init__(self, config: "EngineConfig"):
        self.config = config

    def __call__(self, kv_bytes_per_block: int, state_bytes_per_slot: int, linear_weight_bytes: int,
                 session_len: int, device_free_bytes: int) -> tuple[int, int, int, int]:
        state = plan_state_slots(self.config, state_bytes_per_slot, device_free_bytes)  # no drafts, no disk store
        return (plan_cuda_kv_pool(self.config, kv_bytes_per_block, session_len, device_free_bytes - state.bytes),
                state.num_slots, 0, 0)


def log_cuda_kv_pool(cpp, cache_max_entry_count: float | None) -> None:
    """Logs the start-up line of a CUDA engine (lmkit._engine.Engine), whose pool plan_cuda_kv_pool sized from the
    GPU's free memory (cache_max_entry_count None: AUTO_MEMORY_FRACTION of it)."""
    n, block, per_block = cpp.num_total_blocks, cpp.block_size_tokens, cpp.kv_bytes_per_block
    share = AUTO_MEMORY_FRACTION if cache_max_entry_count is None else cache_max_entry_count
    why = (f"set by cache_max_entry_count={n}" if share > 1 else
           f"{share:g} of the GPU memory free after the weights{' (auto)' if cache_max_entry_count is None else ''}, "
           "at most max_batch_size x session_len")
    log.info("KV pool: %d blocks x %d tokens = %d tokens, %s of GPU memory (%s per block); %s", n, block, n * block,
             format_bytes(n * per_block), format_bytes(per_block), why)
