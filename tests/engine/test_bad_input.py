"""Bad input gets a clear Python exception naming the problem, and the engine keeps serving."""

from __future__ import annotations

import json
import shutil

import pytest

from lmkit import EngineConfig, GenerationConfig, pipeline
from lmkit.messages import GenerationConfigError


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        pipeline(tmp_path / "nope", EngineConfig(device="cpu"))


def test_unsupported_architecture(tiny_llama, tmp_path):
    folder = tmp_path / "gpt2ish"
    shutil.copytree(tiny_llama[0], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        pipeline(folder, EngineConfig(device="cpu"))


@pytest.mark.parametrize("damage", ["truncate", "garbage-header", "huge-header-length"])
def test_corrupt_safetensors(tiny_llama, tmp_path, damage):
    folder = tmp_path / damage
    shutil.copytree(tiny_llama[0], folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncate":
        weights.write_bytes(data[: len(data) // 2])
        match = "truncated"
    elif damage == "garbage-header":
        weights.write_bytes(data[:8] + b"\xff" * 64 + data[72:])
        match = "corrupt safetensors header"
    else:
        weights.write_bytes((2**40).to_bytes(8, "little") + data[8:])
        match = "corrupt safetensors header"
    with pytest.raises(ValueError, match=match):
        pipeline(folder, EngineConfig(device="cpu"))


def test_wrong_tensor_shape_names_the_tensor(tiny_llama, tmp_path):
    folder = tmp_path / "shape"
    shutil.copytree(tiny_llama[0], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 128  # the saved MLP weights are 160 wide
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="gate_proj.*shape"):
        pipeline(folder, EngineConfig(device="cpu"))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=-1), "max_new_tokens must be"),
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-1), "top_k must be"),
        (dict(min_p=1.0), "min_p must be"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be"),
    ],
)
def test_impossible_generation_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GenerationConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field, match",
    [
        (dict(top_k=2**31), "top_k", r"\[0, 2147483647\]"),
        (dict(top_k=True), "top_k", "integer"),
        (dict(stop_token_ids=[3, 2**32]), "stop_token_ids", "got 4294967296 at index 1"),
        (dict(stop_token_ids=[-1]), "stop_token_ids", "got -1"),
        (dict(random_seed=2**64), "random_seed", r"\[0, 2\*\*64\)"),
        (dict(repetition_penalty=1e308), "repetition_penalty", "finite number the engine's float32 holds"),
        (dict(temperature=float("nan")), "temperature", "finite number"),
        (dict(presence_penalty=float("-inf")), "presence_penalty", "finite number"),
        (dict(temperature="hot"), "temperature", "finite number"),
        (dict(top_p=1e-50), "top_p", r"as a float32: 0\.0"),
        (dict(min_p=0.99999999999), "min_p", r"as a float32: 1\.0"),
        (dict(max_new_tokens=2**31), "max_new_tokens", r"\[0, 2147483647\]"),
        (dict(max_new_tokens=4, min_new_tokens=5), "min_new_tokens", r"must not exceed .*\(4\), got 5"),
        (dict(n=2**31), "n", r"\[1, 2147483647\]"),
        (dict(stop=["ok", ""]), "stop", "non-empty strings, got '' at index 1"),
        (dict(logprobs=21), "logprobs", r"\[0, 20\]"),
        (dict(prompt_logprobs=21), "prompt_logprobs", r"\[0, 20\]"),
        (dict(prompt_logprobs=-1), "prompt_logprobs", r"\[0, 20\]"),
    ],
)
def test_generation_config_names_the_field(kwargs, field, match):
    """Whatever the engine's SamplingParams (int32, float32, uint64) cannot hold is refused here, by name."""
    with pytest.raises(GenerationConfigError, match=match) as e:
        GenerationConfig(**kwargs)
    assert e.value.field == field and str(e.value).startswith(f"{field} ")


def test_generation_config_against_the_engine(tiny_llama_pipe):
    engine = tiny_llama_pipe.engine
    vocab = engine.spec.vocab_size
    limits = dict(vocab_size=vocab, max_batch_size=engine.config.max_batch_size)
    GenerationConfig(stop_token_ids=[0, vocab - 1], n=limits["max_batch_size"]).check_limits(**limits)
    with pytest.raises(GenerationConfigError, match=rf"vocabulary \[0, {vocab}\), got {vocab} at index 1") as e:
        GenerationConfig(stop_token_ids=[1, vocab]).check_limits(**limits)
    assert e.value.field == "stop_token_ids"
    with pytest.raises(GenerationConfigError, match="max_batch_size") as e:
        GenerationConfig(n=limits["max_batch_size"] + 1).check_limits(**limits)
    assert e.value.field == "n"


def test_values_the_binding_cannot_hold_never_reach_it(tiny_llama_pipe):
    """They were TypeErrors from pybind (incompatible function arguments) once the pipeline ran."""
    pipe = tiny_llama_pipe
    gen = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    good = pipe([3, 4, 5], gen).token_ids
    for kwargs in (dict(top_k=2**31), dict(stop_token_ids=[2**32]), dict(max_new_tokens=2**31),
                   dict(min_new_tokens=2**40, max_new_tokens=4), dict(n=2**31)):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            pipe([3, 4, 5], GenerationConfig(**{"max_new_tokens": 4, **kwargs}))
    assert pipe([3, 4, 5], gen).token_ids == good


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_batch_size=0), "max_batch_size"),
        (dict(cache_max_entry_count=0), "cache_max_entry_count"),
        (dict(session_len=1), "session_len"),
        (dict(quant_policy=3), "quant_policy"),
        (dict(device="tpu"), "device"),
        (dict(device="cuda", dtype="float32"), "CUDA backend computes in float16"),
        (dict(device="cuda", dtype="bfloat16"), "CUDA backend computes in float16"),
        (dict(dtype="float16"), "dtype must be auto, float32 or bfloat16"),
        *[(dict(decode_slowdown=bad), "decode_slowdown") for bad in (1.0, 0.5, -1, float("inf"), float("nan"), True)],
    ],
)
def test_impossible_engine_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_bad_requests_then_engine_still_serves(tiny_llama_pipe):
    pipe = tiny_llama_pipe
    gen = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    good = pipe([3, 4, 5], gen).token_ids
    with pytest.raises(ValueError, match="prompt is empty"):
        pipe("", gen)
    with pytest.raises(ValueError, match="prompts must be"):
        pipe([], gen)
    for bad_id in (100000, -1, 2**40):  # -1 and 2**40 were pybind TypeErrors
        with pytest.raises(ValueError, match=rf"token id {bad_id} at position 2 is outside the vocabulary"):
            pipe([3, 4, bad_id], gen)
    for prompt in ("ab\ud800c", [{"role": "user", "content": "\udfff"}]):  # tokenizers raised a TypeError
        with pytest.raises(ValueError, match="lone surrogate"):
            pipe(prompt, gen)
    vocab = pipe.engine.spec.vocab_size
    with pytest.raises(GenerationConfigError, match="stop_token_ids"):
        pipe([3, 4, 5], GenerationConfig(max_new_tokens=4, stop_token_ids=[vocab]))
    with pytest.raises(GenerationConfigError, match="max_batch_size"):
        pipe([3, 4, 5], GenerationConfig(max_new_tokens=4, n=pipe.engine.config.max_batch_size + 1))
    too_long = [1] * pipe.engine.session_len
    with pytest.raises(ValueError, match="session_len"):
        pipe(too_long, gen)
    with pytest.raises(ValueError, match="'role' and 'content'"):
        pipe([{"content": "no role"}], gen)
    # A bad prompt in a batch fails the batch before anything runs.
    with pytest.raises(ValueError, match="prompt is empty"):
        pipe(["abc", ""], gen)
    assert pipe([3, 4, 5], gen).token_ids == good


def test_request_that_can_never_fit_the_pool_fails_at_once(tiny_llama):
    with pipeline(tiny_llama[0], EngineConfig(device="cpu", cache_max_entry_count=4, cache_block_seq_len=16)) as pipe:
        r = pipe([1, 2, 3], GenerationConfig(max_new_tokens=100, ignore_eos=True))
        assert r.finish_reason == "error" and "KV pool" in r.error and r.token_ids == []
        ok = pipe([1, 2, 3], GenerationConfig(max_new_tokens=60, ignore_eos=True))
        assert ok.finish_reason == "length" and len(ok.token_ids) == 60


def test_session_len_caps_generation(tiny_llama):
    with pipeline(tiny_llama[0], EngineConfig(device="cpu", session_len=20, cache_max_entry_count=32,
                                              cache_block_seq_len=16)) as pipe:
        r = pipe([1] * 15, GenerationConfig(max_new_tokens=100, ignore_eos=True))
        assert r.finish_reason == "length" and len(r.token_ids) == 5


def test_closed_pipeline_refuses_work(tiny_llama):
    pipe = pipeline(tiny_llama[0], EngineConfig(device="cpu", cache_max_entry_count=32))
    pipe.close()
    pipe.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pipe([1, 2], GenerationConfig(max_new_tokens=2))


def test_cuda_device_without_a_gpu_is_a_clear_error(tiny_llama):
    """device='cuda' where the build has no CUDA backend or no GPU is usable: ValueError saying which."""
    from tests.helpers import cuda_usable

    if cuda_usable():
        pytest.skip("a GPU is usable here")
    with pytest.raises(ValueError, match=r"device='cuda' but (no CUDA GPU|lmkit._engine was built without)"):
        pipeline(tiny_llama[0], EngineConfig(device="cuda"))


def test_auto_device_without_a_gpu_runs_on_the_cpu_and_says_why(tiny_llama, caplog):
    """device='auto' (the default) where the CUDA backend is not built or no GPU is usable: the CPU engine, one
    log line naming why (tests/engine/test_cuda.py checks auto on a GPU and its fallback for refused models)."""
    import logging

    from tests.helpers import cuda_usable

    if cuda_usable():
        pytest.skip("a GPU is usable here")
    with caplog.at_level(logging.INFO, logger="lmkit"):
        with pipeline(tiny_llama[0], EngineConfig(cache_max_entry_count=32)) as pipe:
            assert pipe.engine.device == "cpu"
            assert len(pipe([1, 2, 3], GenerationConfig(max_new_tokens=3, ignore_eos=True)).token_ids) == 3
    said = [r.getMessage() for r in caplog.records if "device='auto'" in r.getMessage()]
    assert said in (["device='auto': the CPU backend, since no CUDA GPU is usable here (no driver or no device)"],
                    ["device='auto': the CPU backend, since lmkit._engine was built without the CUDA backend (no "
                     "CUDA toolkit at install time, or LMKIT_CUDA=OFF)"]), said


def test_deprecated_int8_activations_name_still_works():
    """awq_int8_activations (the old name: it governs every int4 and int8 layer) sets int8_activations, warning."""
    with pytest.warns(DeprecationWarning, match="use int8_activations"):
        config = EngineConfig(awq_int8_activations=False)
    assert config.int8_activations is False and config.awq_int8_activations is None
    assert config.to_engine_config("cpu").int8_activations is False
