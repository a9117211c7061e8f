"""lmkit's engine as an lm-evaluation-harness model, registered as ``lmkit`` when this module is imported:

    lm_eval --model lmkit --model_args pretrained=FOLDER,dtype=float32 --tasks ... (after ``import lmkit.lite.harness``)
    lmkit lite eval FOLDER [FOLDER ...] --tasks ...                                (does the import)

loglikelihood    each (context, continuation) pair is one prompt computed with max_new_tokens 0 and
                 prompt_logprobs 1: the continuation's logprob is the sum over its tokens, greedy when each of
                 them is the most likely token at its position (as lm-eval's ``hf`` model decides).
loglikelihood_rolling  lm-eval's disjoint rolling windows of max_length tokens, scored the same way.
generate_until   greedy (or the task's temperature) generation with the task's stop strings.

Tokenization is lm-eval's (TemplateLM: trailing spaces of the context move to the continuation, the pair is
encoded whole and split) over the model's own tokenizer, without special tokens unless ``add_bos_token``: the
``hf`` model's defaults, so both score the same token ids.
"""

from __future__ import annotations

from pathlib import Path

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from lmkit import EngineConfig, GenerationConfig, pipeline

SUBMIT_CHUNK = 256  # prompts handed to the engine at once (it batches them continuously)


@register_model("lmkit")
class LmkitLM(TemplateLM):
    """An lm-eval model over lmkit's engine (CPU by default). ``pretrained``: an HF or AWQ folder (None: the
    bundled SmolLM2); the engine keys (dtype, device, num_threads, max_batch_size) as in EngineConfig."""

    def __init__(self, pretrained: str | Path | None = None, dtype: str = "auto", device: str = "cpu",
                 num_threads: int | None = None, max_batch_size: int = 32, max_length: int | None = None,
                 max_gen_toks: int = 256, add_bos_token: bool = False, batch_size: int | str | None = None,
                 **ignored):
        super().__init__()
        if device not in ("cpu", "cuda", "auto"):  # lm-eval passes torch device names (cuda:0) through
            device = "cuda" if str(device).startswith("cuda") else "cpu"
        config = EngineConfig(device=device, dtype=dtype, num_threads=num_threads, max_batch_size=int(max_batch_size))
        self.pipe = pipeline(None if pretrained in (None, "", "smollm2") else pretrained, config)
        engine = self.pipe.engine
        self.tok = engine.tokenizer
        self.max_length = int(max_length or engine.session_len - 1)  # a prompt must leave one position
        if self.max_length >= engine.session_len:
            raise ValueError(f"max_length {self.max_length} must be below the engine's session_len "
                             f"{engine.session_len}")
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = bool(add_bos_token)
        self._eot = engine.spec.eos_token_ids[0]

    # ---- tokenization (TemplateLM) ------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self._eot

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        add = self.add_bos_token if add_special_tokens is None else add_special_tokens
        return self.tok.encode(string, add_special_tokens=add)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens, skip_special_tokens=True)

    @property
    def tokenizer_name(self) -> str:
        return str(self.pipe.engine.model_path).replace("/", "__")

    # ---- scoring --------------------------------------------------------------------------------------------

    def _score(self, pairs: list[tuple[list[int], list[int]]], disable_tqdm: bool) -> list[tuple[float, bool]]:
        """(sum of the continuation's logprobs, whether it is greedy) of each (context ids, continuation ids)."""
        prompts = []
        for context, continuation in pairs:
            if not continuation:
                raise ValueError("lmkit: a loglikelihood request has an empty continuation")
            prompts.append((context + continuation)[-self.max_length:])
        gen = GenerationConfig(max_new_tokens=0, prompt_logprobs=1)
        results = []
        bar = tqdm(total=len(prompts), desc="lmkit loglikelihood", disable=disable_tqdm)
        for start in range(0, len(prompts), SUBMIT_CHUNK):
            chunk = prompts[start:start + SUBMIT_CHUNK]
            responses = self.pipe(chunk, gen)
            for (_, continuation), prompt, r in zip(pairs[start:start + SUBMIT_CHUNK], chunk, responses):
                if r.finish_reason == "error":
                    raise RuntimeError(f"lmkit: scoring failed: {r.error}")
                total, greedy = 0.0, True
                for p in range(len(prompt) - len(continuation), len(prompt)):
                    entry = r.prompt_logprobs[p]
                    value = entry[prompt[p]]
                    total += value
                    greedy = greedy and value >= max(entry.values())
                results.append((total, greedy))
            bar.update(len(chunk))
        bar.close()
        return results

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = self._score([(context, continuation) for _, context, continuation in requests], disable_tqdm)
        for (key, _, _), result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for (string,) in tqdm([r.args for r in requests], desc="lmkit rolling", disable=disable_tqdm):
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            total = sum(lp for lp, _ in self._score(windows, disable_tqdm=True))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    # ---- generation ------------------------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests with the same generation settings run as one batch."""
        groups: dict[tuple, list[int]] = {}
        prompts = []
        for i, (context, kwargs) in enumerate(r.args for r in requests):
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
            do_sample = bool(kwargs.pop("do_sample", False)) and temperature > 0
            prompts.append(self.tok_encode(context)[-(self.max_length - max_new):])
            key = (max_new, tuple(u for u in until if u), do_sample, temperature if do_sample else 1.0)
            groups.setdefault(key, []).append(i)
        out: list[str] = [""] * len(prompts)
        bar = tqdm(total=len(prompts), desc="lmkit generate", disable=disable_tqdm)
        for (max_new, until, do_sample, temperature), members in groups.items():
            gen = GenerationConfig(max_new_tokens=max_new, stop=list(until), do_sample=do_sample,
                                   temperature=temperature)
            for start in range(0, len(members), SUBMIT_CHUNK):
                chunk = members[start:start + SUBMIT_CHUNK]
                for i, r in zip(chunk, self.pipe([prompts[i] for i in chunk], gen)):
                    if r.finish_reason == "error":
                        raise RuntimeError(f"lmkit: generation failed: {r.error}")
                    out[i] = r.text
                    self.cache_hook.add_partial("generate_until", requests[i].args, r.text)
                bar.update(len(chunk))
        bar.close()
        return out

    def close(self) -> None:
        self.pipe.close()
