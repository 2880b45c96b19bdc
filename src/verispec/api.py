"""The Python API, in vLLM's shape: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import logging
import sys
from typing import Any, Mapping, Sequence, Union

import torch
from tqdm.auto import tqdm

from verispec.check.state import check_kv
from verispec.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, ModelConfig, SpeculativeConfig
from verispec.drafters import DrafterFactory
from verispec.drafters.base import needs_features
from verispec.execution.features import target_features
from verispec.engine.args import EngineArgs
from verispec.engine.core import Engine, EngineConfig, TokenCallback
from verispec.engine.costs import MeasuredStepCosts, StepCosts
from verispec.engine.scheduler import make_policy
from verispec.execution.autotune import PathChoice, resolve_path
from verispec.execution.invariance import linears_row_invariant
from verispec.execution.stream_choice import choose_model_streams
from verispec.execution.hidden_states import hidden_states
from verispec.sampling.logprobs import vllm_logprobs
from verispec.engine.profile import profile_costs, profile_step_costs
from verispec.sampling import SamplingParams
from verispec.sampling.processor import ProcessorFactory
from verispec.kernels.cpu import release_freed_memory
from verispec.kernels.threads import release_openmp_threads
from verispec.state.kv_cache import check_fits
from verispec.execution.verify import AcceptanceConfig
from verispec.models import hub
from verispec.models.hub import DEFAULT_MODEL
from verispec.models.loader import (ResolvedModel, gguf_has_int4_linears, load_model, load_tokenizer, read_config,
                                    resolve)
from verispec.state.paged_kv import PagedKVCache
from verispec.outputs import RequestOutput
from verispec.state.request import Request
from verispec.tools import constrain as constrain_tools
from verispec.tools import parse_output as parse_tool_output
from verispec.tools import render as render_tools
from verispec.tools import tool_spec, value_error

log = logging.getLogger(__name__)

Prompt = Union[str, dict[str, Any], Sequence[int]]
Message = dict[str, str]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# The default KV budget when max_num_seqs x max_model_len positions would need more (vLLM's CPU backend also
# defaults to a few GiB): requests then share it and the newest is preempted when it runs out.
DEFAULT_KV_CACHE_BYTES = 4 << 30
DEFAULT_CONTEXT_CAP = 4096  # max_model_len when none is given: the model's own, at most this


def _say(text: str, progress: bool) -> None:
    """A choice made while building: logged, and said on stderr as "verispec: ..." when `progress` is on."""
    log.info("%s", text)
    if progress:
        print(f"verispec: {text}", file=sys.stderr, flush=True)


class LLM:
    """vLLM's `LLM`: a target model, its drafter and a continuous-batching engine over one paged KV cache."""

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any) -> None:
        """The keywords are `EngineArgs`' fields (engine/args.py, where each one's default is written): dtype,
        device, max_model_len, speculative_config, max_num_seqs, scheduler, enable_prefix_caching, ..."""
        self._build(EngineArgs(model=model, **kwargs))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLM":
        llm = cls.__new__(cls)
        llm._build(args)
        return llm

    def _build(self, args: EngineArgs) -> None:
        self.args = args
        self.device = args.device or default_device()
        self.resolved = resolve(args.model, args.progress)
        spec = self._parse_speculation(args.speculative_config)  # bad input fails before anything loads
        cfg = ModelConfig.from_hf(read_config(self.resolved.directory))
        self.path_choice = self._choose_path(self.resolved, cfg, args.dtype, args.quantization, spec, args.progress,
                                             args.invariant)
        self.dtype, self.quantization = self.path_choice.path.dtype, self.path_choice.path.quantization
        # K/V take 46 KB per position for the default model (fp32 on CPU); by default the paged cache holds
        # max_num_seqs x max_model_len positions (as one slot per request did) up to DEFAULT_KV_CACHE_BYTES, so the
        # default context is capped at DEFAULT_CONTEXT_CAP unless asked for more; kv_cache_memory_bytes sizes it by
        # memory instead. The RoPE tables cover max_model_len positions, not the model's (Llama-3.2's 131,072 x 64
        # pairs of float32 would be 64 MiB)
        self.max_model_len = min(args.max_model_len or min(cfg.max_position_embeddings, DEFAULT_CONTEXT_CAP),
                                 cfg.max_position_embeddings)
        # the tokenizer before the weights: the JSON its load parses and frees is handed back first, so the peak RSS
        # does not carry it on top of the weights (a 1.5B Q4_K_M: docs/results/shapes.md)
        self.tokenizer = load_tokenizer(self.resolved)
        release_freed_memory()
        self.model, _ = load_model(self.resolved, dtype=self.dtype, device=self.device, max_len=self.max_model_len,
                                   progress=args.progress, quantization=self.quantization)
        self.model.kv_cache_dtype = None if args.kv_cache_dtype == "auto" else getattr(torch, args.kv_cache_dtype)
        self.kv_cache_dtype = str(self.model.kv_dtype).removeprefix("torch.")
        # the kernel's one-row prefetch level timed on this model's own forwards (models of 32 MiB and more)
        self.stream_choice = choose_model_streams(self.model, hub.cache_dir())
        if self.stream_choice is not None:
            _say(self.stream_choice.describe(), args.progress)
        self._set_invariance(args.invariant)
        self.max_num_seqs = args.max_num_seqs
        self.scheduler = args.scheduler
        self.max_num_batched_tokens = args.max_num_batched_tokens
        self.kv_cache_memory_bytes, self.block_size = args.kv_cache_memory_bytes, args.block_size
        self.enable_prefix_caching = args.enable_prefix_caching
        self.cache = self._new_cache()
        eos = set(cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_ids = frozenset(eos)
        self._costs: StepCosts | None = None
        self.check_state = args.check_state
        # verispec's kernel splits a forward by output rows and heads: its tokens do not depend on the thread count
        q8act = torch.device(self.device).type == "cpu" and self.quantization == "gguf-q8act"
        self.adaptive_threads = torch.get_num_threads() if args.adaptive_threads and q8act else 0
        self._engine: Engine | None = None
        self._set_speculation(spec)
        # building ran kernels on this thread (the path's profile); give its OpenMP threads back so that a worker
        # thread running this LLM later is the process's only OpenMP user (kernels/threads.py); made again here
        # on this thread's next forward
        release_openmp_threads()

    def _choose_path(self, resolved: ResolvedModel, cfg: ModelConfig, dtype: str, quantization: str | None,
                     spec: SpeculativeConfig, progress: bool, invariant: bool | None) -> PathChoice:
        """The weight path: named by dtype / quantization, or measured for this machine when dtype="auto"
        (execution/autotune.py) for the blocks `spec` verifies; said on stderr when `progress` is on, and in
        every output's stats."""
        k = 0 if spec.method == "none" else spec.num_speculative_tokens
        from verispec.models.quantized import gguf_block_linears

        choice = resolve_path(dtype, quantization, self.device, cfg, gguf_has_int4_linears(resolved), k,
                              cache=hub.cache_dir(), invariant_only=bool(invariant),
                              gguf_blocks=gguf_block_linears(resolved.gguf))
        _say(choice.describe(), progress and not choice.explicit)
        return choice

    def _set_invariance(self, invariant: bool | None) -> None:
        """Batch invariance: a token's logits the same alone, in a verify block or beside other requests, so
        greedy speculative output equals plain output bitwise. Measured on the loaded weights
        (execution/invariance.py); None turns it on where the linears pass, True requires it, False turns it off
        (blocked attention: cheaper verify blocks, identity up to near-ties)."""
        self.linear_invariance = linears_row_invariant(self.model)
        release_freed_memory()  # the check's products, tens of MB at a large vocabulary's head
        measured = all(self.linear_invariance.values())
        if invariant and not measured:
            bad = ", ".join(n for n, ok in self.linear_invariance.items() if not ok)
            raise ValueError(
                f"invariant=True, but on this machine the {self.path_choice.path.name} path's linears round a row "
                f"differently by batch size (measured: {bad}); use dtype='bfloat16' or quantization='gguf'")
        self.model.batch_invariant = measured if invariant is None else invariant
        if invariant is None and not measured:  # a path that breaks bitwise identity is never chosen silently
            bad = ", ".join(n for n, ok in self.linear_invariance.items() if not ok)
            _say(f"the {self.path_choice.path.name} path is not batch-invariant on this machine ({bad} round a row "
                 f"differently by batch size): greedy speculative output equals plain only up to near-ties; "
                 f"invariant=True (--invariant) refuses such a path", self.args.progress)

    def _parse_speculation(self, speculative_config: Mapping[str, Any] | SpeculativeConfig | None
                           ) -> SpeculativeConfig:
        """The one place a speculative_config is parsed (after the shipped drafter is filled in)."""
        from verispec.drafters.shipped import fill_drafter

        return SpeculativeConfig.from_dict(fill_drafter(speculative_config, self.known_model_name, self.resolved.name,
                                                        self.resolved.directory))

    def _set_speculation(self, spec: SpeculativeConfig) -> None:
        self.spec = spec
        if self.spec.draft_tree:
            self.model.cfg.check_tree_depth(self.spec.num_speculative_tokens, "the target")
        self.rule = AcceptanceConfig(self.spec.acceptance_rule, self.spec.threshold_single, self.spec.threshold_acc)
        self.drafters = DrafterFactory(self.spec, self.model, self.tokenizer, self.max_model_len, self.max_num_seqs)
        self._engine = None

    @property
    def known_model_name(self) -> str | None:
        """The registry name (models/hub.py) of the target, when it is a known model (by name, alias or file)."""
        return hub.known_name(self.resolved.name, self.resolved.gguf)

    def with_speculation(self, speculative_config: dict[str, Any] | SpeculativeConfig | None,
                         check_state: bool | None = None) -> "LLM":
        """Another LLM over the same target weights, tokenizer and KV cache, with another drafter."""
        import copy

        other = copy.copy(self)
        other._set_speculation(self._parse_speculation(speculative_config))
        other.check_state = self.check_state if check_state is None else check_state
        other._costs = self._costs
        if other._costs is not None and min(other._max_step_tokens(), 128) > other._costs.table.sizes[-1]:
            other._costs = None
        return other

    def _max_step_tokens(self) -> int:
        return self.max_num_seqs * (self.spec.num_speculative_tokens + 1)

    @property
    def costs(self) -> StepCosts:
        """Target forward time per batched block size, profiled on first use (seconds on CPU)."""
        if self._costs is None:
            if self.max_num_seqs == 1:
                k = self.spec.num_speculative_tokens
                sizes = sorted({1, 2, 3, 4, 6, 8, 12, 16, k + 1} & set(range(1, k + 2)))
                self._costs = StepCosts(profile_costs(self.model, sizes))
            else:
                self._costs = profile_step_costs(self.model, self._max_step_tokens())
        return self._costs

    def configure_engine(self, max_num_seqs: int | None = None, scheduler: str | None = None,
                         enable_prefix_caching: bool | None = None) -> None:
        """Resize the batch and / or turn prefix caching on or off (either: a new, empty KV cache), and / or change
        the policy."""
        if scheduler is not None:
            make_policy(scheduler, StepCosts.flat())  # validates the name
            self.scheduler = scheduler
        if enable_prefix_caching is not None and enable_prefix_caching != self.enable_prefix_caching:
            self.enable_prefix_caching = enable_prefix_caching
            self.cache = self._new_cache()
        if max_num_seqs is not None and max_num_seqs != self.max_num_seqs:
            if max_num_seqs < 1:
                raise ValueError("max_num_seqs must be >= 1")
            self.max_num_seqs = max_num_seqs
            self.cache = self._new_cache()
            if self._costs is not None and min(self._max_step_tokens(), 128) > self._costs.table.sizes[-1]:
                self._costs = None
            self._set_speculation(self.spec)
        self._engine = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt block (vLLM's `LLM.reset_prefix_cache`): the next requests prefill their whole
        prompts, as after a fresh start. For benchmarks that run the same prompts again. In place, so the LLMs of
        `with_speculation`, which share this KV cache, forget them too (a new cache here left them the old one and
        held both in memory). Not while requests run, here or in an LLM sharing the cache."""
        if self._engine is not None and self._engine.has_work():
            raise RuntimeError("reset_prefix_cache: requests are still running")
        if not self.cache.reset_prefix_cache():
            raise RuntimeError("reset_prefix_cache: KV blocks are in use (an LLM sharing this cache is running "
                               "requests)")

    def _new_cache(self) -> PagedKVCache:
        """The engine's paged KV cache: kv_cache_memory_bytes worth of blocks; by default max_num_seqs x
        max_model_len positions' worth, capped at DEFAULT_KV_CACHE_BYTES (but always one full-length request)."""
        c, B = self.model.cfg, self.block_size
        per_block = 2 * c.num_layers * c.num_kv_heads * B * c.head_dim * self.model.kv_dtype.itemsize
        per_request = -(-self.max_model_len // B)
        if self.kv_cache_memory_bytes is None:
            num_blocks = max(per_request, min(self.max_num_seqs * per_request, DEFAULT_KV_CACHE_BYTES // per_block))
            how = f"max_num_seqs={self.max_num_seqs} x max_model_len={self.max_model_len}"
        else:
            num_blocks = self.kv_cache_memory_bytes // per_block
            how = f"kv_cache_memory_bytes={self.kv_cache_memory_bytes}"
            if num_blocks < 1:
                raise ValueError(f"{how} holds no KV block ({per_block} bytes each)")
        check_fits(num_blocks * per_block, self.device, how)
        return self.model.new_paged_cache(self.max_model_len, num_blocks, B, self.max_num_seqs,
                                          self.enable_prefix_caching)

    @property
    def scheduler_name(self) -> str:
        if self.scheduler is not None:
            return self.scheduler
        # dspark: at or above goodput with n-gram drafts on every shipped workload, level with it for EAGLE-3
        # (docs/results/speculation.md, "n-gram confidences scored in hindsight"); the server's default too
        return "dspark" if self.spec.adaptive else "static"

    @property
    def engine(self) -> Engine:
        """The continuous-batching engine over this model's cache (built on first use)."""
        if self._engine is None:
            name = self.scheduler_name
            needs_costs = self.spec.method != "none" and name != "static"
            # the profile, corrected by this engine's own measured forwards
            policy = make_policy(name, MeasuredStepCosts(self.costs) if needs_costs else StepCosts.flat())
            batched = self.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self._max_step_tokens())
            config = EngineConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=batched,
                                  num_speculative_tokens=self.spec.num_speculative_tokens,
                                  draft_tree=self.spec.draft_tree, adaptive_threads=self.adaptive_threads)
            check = self._state_check if self.check_state else None
            self._engine = Engine(self.model, self.cache, self.drafters, policy, self.eos_ids, config, self.rule,
                                  check, detokenize=self.decode if self.tokenizer is not None else None,
                                  processors=self.processors)
        return self._engine

    @property
    def processors(self) -> ProcessorFactory:
        """Structured outputs and sampling controls of this model's requests (one grammar compiler, built at the
        first structured request; shared by the LLMs of `with_speculation`)."""
        if getattr(self, "_processors", None) is None:
            self._processors = ProcessorFactory(self.tokenizer, self.model.cfg.vocab_size, self.eos_ids)
        return self._processors

    # ---- prompts ------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = [int(t) for t in prompt["prompt_token_ids"]]
                self.check_prompt_ids(ids)
                return prompt.get("prompt"), ids
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"{self.resolved.directory} has no tokenizer files; pass token ids instead: "
                    "{'prompt_token_ids': [...]}"
                )
            return prompt, list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            self.check_prompt_ids(ids)
            return None, ids
        raise TypeError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def check_prompt_ids(self, ids: Sequence[int]) -> None:
        """Raise ValueError unless every id is in the target's vocabulary (safe from any thread)."""
        vocab = self.model.cfg.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")

    def apply_chat_template(self, messages: list[Message]) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; send a plain prompt instead")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ---- generation ---------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        on_tokens: TokenCallback | None = None,
    ) -> list[RequestOutput]:
        params_list = sampling_params if isinstance(sampling_params, (list, tuple)) else None
        params = SamplingParams() if sampling_params is None or params_list is not None else sampling_params
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        encoded = [self.encode(p) for p in prompts]  # validate everything before running anything
        if params_list is not None and len(params_list) != len(encoded):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(encoded)} prompts; give one or one each")
        reqs = [Request(ids, params_list[i] if params_list else params) for i, (_, ids) in enumerate(encoded)]
        engine = self.engine
        for r in reqs:  # refuse a request that can never fit before anything runs
            engine.check_fits(r)
        for r in reqs:
            engine.add_request(r, on_tokens)
        bar = tqdm(total=len(reqs), desc="generate", disable=not use_tqdm or len(reqs) < 2)
        try:
            done = 0
            while engine.has_work():
                engine.step()
                now = sum(r.finished for r in reqs)
                bar.update(now - done)
                done = now
        except BaseException:
            engine.fail_all("generation failed")
            raise
        finally:
            bar.close()
        return [self._output(r, text) for r, (text, _) in zip(reqs, encoded)]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        on_tokens: TokenCallback | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = "auto",
        parallel_tool_calls: bool = True,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation or a list of them through the chat template. With `tools` (OpenAI's
        `[{"type": "function", "function": {name, description, parameters}}]`) the prompt is rendered and the
        output parsed as the server does (verispec/tools.py): `tool_choice` "auto" leaves the model free, "required"
        or `{"type": "function", "function": {"name": ...}}` constrains the output to tool calls whose arguments
        follow the parameter schema (one, or several with parallel_tool_calls), "none" renders no tools. Each
        output's `tool_calls` is then the list of OpenAI tool calls parsed from its text (`text` stays the raw
        output); without tools it is None. Bad tools or choices raise ValueError naming the argument."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        spec = tool_spec(tools, tool_choice, parallel_tool_calls)
        if spec is not None:  # `required` / a named function: the tool-call grammar in each request's params
            many = isinstance(sampling_params, (list, tuple))
            given = list(sampling_params) if many else [sampling_params or SamplingParams()]  # type: ignore[list-item]
            params = constrain_tools(given, spec, self.processors.compiler.compile, value_error)
            sampling_params = params if many else params[0]
        prompts = [self.apply_chat_template(c) if spec is None else render_tools(self, c, spec)
                   for c in conversations]  # type: ignore[arg-type]
        # the chat template already holds the special tokens
        encoded = [{"prompt": p, "prompt_token_ids": self.tokenizer(p, add_special_tokens=False)["input_ids"]}
                   for p in prompts]
        outputs = self.generate(encoded, sampling_params, use_tqdm, on_tokens)
        if tools is not None:
            for out in outputs:
                out.tool_calls = parse_tool_output(out.text)[1] if spec is not None else []
        return outputs

    def _state_check(self, req: Request, drafter) -> None:
        """The state oracle (check_state=True), after every step: the target's KV, then the drafter's own state
        through its protocol (drafters/base.py)."""
        tokens = req.all_ids[: req.num_computed]
        check_kv(self.model, self.cache, req.slot, tokens, "target")
        if needs_features(drafter):
            ref, _ = target_features(self.model, tokens, drafter.feature_layers)
            drafter.check_state(ref, tokens)
        check_own_state = getattr(drafter, "check_own_state", None)
        if check_own_state is not None:
            check_own_state(tokens)

    def _output(self, req: Request, prompt: str | None) -> RequestOutput:
        stats = req.stats.as_dict()
        stats.update(req.spec.as_dict())
        stats["method"] = self.spec.method
        stats["drafter_weights"] = self.drafters.weight_format
        if self.drafters.synthetic is not None:  # method synthetic: a benchmark-only mode, labelled lossy
            from verispec.drafters.synthetic import LABEL

            stats.update(lossy=True, synthetic_acceptance=f"{LABEL} (tau {self.spec.synthetic_tau})")
        stats.update(self.path_choice.as_dict())
        stats["kv_cache_dtype"] = self.kv_cache_dtype
        stats["batch_invariant"] = self.model.batch_invariant
        stats["scheduler"] = self.scheduler_name
        return RequestOutput(
            request_id=req.request_id,
            prompt=prompt,
            prompt_token_ids=req.prompt_ids,
            text=self.decode(req.output_ids) if req.stop_text is None else req.stop_text,  # cut at a stop string
            token_ids=list(req.output_ids),
            finish_reason=req.finish_reason,
            stats=stats,
            stop_reason=req.stop_reason,
            logprobs=None if req.params.logprobs is None else vllm_logprobs(
                req.output_logprobs, self.decode if self.tokenizer is not None else None),
            hidden_states=hidden_states(req, self.model.cfg.hidden_size),
        )
